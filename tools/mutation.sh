#!/usr/bin/env bash
# Mutation testing of the modules [tool.mutmut] in pyproject.toml names, on a copy of the
# committed tree (mutmut writes its mutants/ folder there, never into bole/ in place).
#   tools/mutation.sh [WORKDIR]            run, then print the results
#   MUTMUT_ONLY="*bole/engine/scheduler.py" tools/mutation.sh   one module (fnmatch pattern)
#   MUTMUT_NAMES="bole.server.protocol.x_logprobs_body*" ...     only these mutants (mutmut's
#                                        names, fnmatch patterns, space-separated)
# Needs the `mutation` extra (pip install -e .[test,mutation]). OMP_NUM_THREADS=1 keeps torch
# from oversubscribing a small machine (each mutant's tests run in a forked process).
set -euo pipefail
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
work=${1:-$(mktemp -d /tmp/bole-mutation.XXXXXX)}
mkdir -p "$work"
git -C "$repo" archive HEAD | tar -x -C "$work"
cd "$work"
if [ -n "${MUTMUT_ONLY:-}" ]; then
  python - "$MUTMUT_ONLY" <<'PY'
import re, sys
text = open("pyproject.toml").read()
pattern = ", ".join(f'"{p}"' for p in sys.argv[1].split(","))
text = re.sub(r"only_mutate = \[[^\]]*\]", f"only_mutate = [{pattern}]", text)
open("pyproject.toml", "w").write(text)
PY
fi
export OMP_NUM_THREADS=1
# shellcheck disable=SC2086  (MUTMUT_NAMES: patterns, split on spaces, not globbed here)
set -f
mutmut run --max-children "${MUTMUT_CHILDREN:-2}" ${MUTMUT_NAMES:-} || true
set +f
mutmut results --all true > results.txt || mutmut results > results.txt
echo "mutation results in $work/results.txt"
sed 's/.*: //' results.txt | sort | uniq -c      # mutants by status ("not checked": not run)
