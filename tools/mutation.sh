#!/usr/bin/env bash
# Mutation testing of the modules [tool.mutmut] in pyproject.toml names, on a copy of the
# committed tree (mutmut writes its mutants/ folder there, never into bole/ in place).
#   tools/mutation.sh [WORKDIR]            run, then print the results
#   MUTMUT_ONLY="*bole/engine/scheduler.py" tools/mutation.sh   one module (fnmatch pattern)
#   MUTMUT_NAMES="bole.server.protocol.x_logprobs_body*" ...     only these mutants (mutmut's
#                                        names, fnmatch patterns, space-separated)
#   MUTMUT_TESTS="tests/a.py,tests/b.py" ...   these test files instead of the configured ones
#                                        (a shorter stats run when only some modules are run)
#   MUTMUT_DESELECT="process" ...        also deselect the tests whose names hold this word
# Mutants the per-function selection misses, or survivors to rerun: tools/mutation_recheck.sh.
# Needs the `mutation` extra (pip install -e .[test,mutation]). OMP_NUM_THREADS=1 keeps torch
# from oversubscribing a small machine (each mutant's tests run in a forked process).
set -euo pipefail
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
work=${1:-$(mktemp -d /tmp/bole-mutation.XXXXXX)}
mkdir -p "$work"
git -C "$repo" archive HEAD | tar -x -C "$work"
cd "$work"
python - "${MUTMUT_ONLY:-}" "${MUTMUT_TESTS:-}" "${MUTMUT_DESELECT:-}" <<'PY'
import re, sys
text = open("pyproject.toml").read()
if sys.argv[3]:                        # one more -k exclusion: "process" -> "... and not process"
    text = re.sub(r'("not sampled[^"]*)"', rf'\1 and not {sys.argv[3]}"', text, count=1)
for key, value in (("only_mutate", sys.argv[1]), ("pytest_add_cli_args_test_selection",
                                                    sys.argv[2])):
    if value:
        items = ", ".join(f'"{p}"' for p in value.split(","))
        text = re.sub(key + r" = \[[^\]]*\]", f"{key} = [{items}]", text)
open("pyproject.toml", "w").write(text)
PY
export OMP_NUM_THREADS=1
# shellcheck disable=SC2086  (MUTMUT_NAMES: patterns, split on spaces, not globbed here)
set -f
mutmut run --max-children "${MUTMUT_CHILDREN:-2}" ${MUTMUT_NAMES:-} || true
set +f
mutmut results --all true > results.txt || mutmut results > results.txt
echo "mutation results in $work/results.txt"
sed 's/.*: //' results.txt | sort | uniq -c      # mutants by status ("not checked": not run)
