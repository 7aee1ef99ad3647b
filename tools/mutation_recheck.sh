#!/usr/bin/env bash
# Run mutants by hand in a work directory tools/mutation.sh made (its mutants/ copy), each
# against the given tests: for mutants mutmut's per-function selection misses (code run on a
# thread started by a module-scoped fixture, or in a spawned process) and to rerun survivors
# after new tests (copy the new test files into WORKDIR/mutants/tests/ first).
#   tools/mutation_recheck.sh WORKDIR NAMES_FILE OUT_FILE [pytest args and test files...]
# NAMES_FILE: one mutant name a line (mutmut results --all true | cut -d: -f1); OUT_FILE gets
# "<name> killed|survived|timeout". RECHECK_TIMEOUT: seconds a mutant (default 60; a hang is
# a timeout, which the tests caught).
set -uo pipefail
work=$1; names=$2; out=$3; shift 3
export OMP_NUM_THREADS=1
cd "$work/mutants"
: > "$out"
while read -r m; do
  [ -z "$m" ] && continue
  MUTANT_UNDER_TEST="$m" PYTHONPATH="$work/mutants" timeout "${RECHECK_TIMEOUT:-60}" \
    python -m pytest -x -q -p no:cacheprovider "$@" > /dev/null 2>&1
  case $? in 0) st=survived;; 124) st=timeout;; 1) st=killed;; *) st="error$?";; esac
  echo "$m $st" >> "$out"
done < "$names"
