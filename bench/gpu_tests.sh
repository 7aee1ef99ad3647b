#!/usr/bin/env bash
# Compiled tests on a GPU machine, in parallel shards that share the GPU and the CPUs compiling its
# Triton kernels (a cold compiled tests/ops run took over 560 s in one process on the H200's 16
# cores). Each shard is one pytest process over every n-th test (BOLE_TEST_SHARD, tests/conftest.py).
#
#   bash bench/gpu_tests.sh LOG_DIR SHARDS [pytest args...]
#   bash bench/gpu_tests.sh $OUT/tests 4 tests/ops tests/models/test_gdn_vs_transformers.py
#
# Writes LOG_DIR/summary.txt: device, versions, commit, date, each shard's last line, the failures,
# then every shard's whole log (LOG_DIR/shard-<i>.txt while they run); exits non-zero if any shard
# failed.
set -u
log_dir=$1; shards=$2; shift 2
mkdir -p "$log_dir"
{
  nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  # a copied working tree may carry an older checkout's .git: the hash of the sources says which
  # files ran (compare: cat $(git ls-files 'bole/*.py' 'tests/*.py') | sha1sum)
  echo "git: $(git log -1 --format='%h %s' 2>/dev/null | cut -c1-100)"
  # (a copy without .git, as bench/h200_runs.sh's callers send: every .py file, sorted)
  sources=$(git ls-files 'bole/*.py' 'tests/*.py' 2>/dev/null)
  [ -n "$sources" ] || sources=$(find bole tests -name '*.py' | LC_ALL=C sort)
  echo "sources: $(cat $sources | sha1sum | cut -c1-12)"
  date -u
  echo "pytest $* in $shards shards"
} > "$log_dir/summary.txt"
# CPU-bound tests (the bundled model's greedy runs) in n processes of all-core torch threads
# oversubscribe the cores many times over: give each shard its share
threads=$(( $(nproc) / shards )); [ "$threads" -lt 1 ] && threads=1
pids=()
for ((i = 0; i < shards; i++)); do
  OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads BOLE_TEST_SHARD="$i/$shards" python3 -m pytest -q -p no:cacheprovider --durations=5 "$@" \
    > "$log_dir/shard-$i.txt" 2>&1 &
  pids+=($!)
done
rc=0
for ((i = 0; i < shards; i++)); do
  wait "${pids[$i]}"; r=$?
  [ "$r" -ne 0 ] && rc=$r
  echo "shard $i/$shards rc=$r: $(grep -E '(passed|failed|error)' "$log_dir/shard-$i.txt" | tail -1)" \
    >> "$log_dir/summary.txt"
done
grep -h -E '^(FAILED|ERROR) ' "$log_dir"/shard-*.txt >> "$log_dir/summary.txt"
cat "$log_dir/summary.txt"
# one file of every shard's log, after the summary (the device tool returns few files)
for ((i = 0; i < shards; i++)); do echo "==== shard $i/$shards"; cat "$log_dir/shard-$i.txt"; done \
  >> "$log_dir/summary.txt" && rm -f "$log_dir"/shard-*.txt
exit $rc
