#!/usr/bin/env bash
# tools/mutation_recheck_inprocess.py in SHARDS processes at once (a GPU machine's cores and one
# GPU shared), each over every SHARDS-th name, plus one process running the same tests on the
# unmutated code (its result says whether the others mean anything). Run in a copy of the tree
# whose bole/ holds mutmut's mutated modules (mutants/bole/... of a tools/mutation.sh work
# directory), with mutmut importable (its trampolines import mutmut.mutation.trampoline):
#
#   SHARDS=6 DEADLINE_S=500 RECHECK_TIMEOUT=150 \
#     bash tools/mutation_recheck_shards.sh NAMES_FILE OUT_DIR tests/test_round_cuda.py
#
# OUT_DIR/<stem>-<i>.txt: "<name> killed|survived|timeout|error<rc>" a line, appended as each
# mutant ends (a shard still running at DEADLINE_S is stopped and keeps what it finished);
# OUT_DIR/<stem>-baseline.txt: the unmutated run's last lines. <stem> is NAMES_FILE's name.
set -u
names=$1; out=$2; shift 2
shards=${SHARDS:-4}; deadline=${DEADLINE_S:-550}
stem=$(basename "$names" .txt)
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
threads=$(( $(nproc) / (shards + 1) )); [ "$threads" -lt 1 ] && threads=1
export OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads
(MUTANT_UNDER_TEST="" timeout "$deadline" python3 -m pytest -q -p no:cacheprovider \
   --durations=8 "$@" 2>&1 | tail -20 > "$out/$stem-baseline.txt") &
pids=($!)
for ((i = 0; i < shards; i++)); do
  awk -v n="$shards" -v i="$i" 'NF && (NR - 1) % n == i' "$names" > "$out/.$stem-names-$i"
  timeout "$deadline" python3 "$here/mutation_recheck_inprocess.py" "$out/.$stem-names-$i" \
    "$out/$stem-$i.txt" "$@" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
rm -f "$out"/.$stem-names-*
echo "$stem: $(cat "$out"/$stem-[0-9]*.txt 2>/dev/null | awk '{print $2}' | sort | uniq -c | tr '\n' ' ')"
echo "baseline: $(grep -E 'passed|failed|error' "$out/$stem-baseline.txt" | tail -1)"
