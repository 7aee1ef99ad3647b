#!/usr/bin/env bash
# The measurement suite on a lent GPU: the runs whose results README.md and docs/ cite, in parts
# that each fit the device tool's 10 minutes a command. Run one part per call, carrying .whl
# (docs/benchmarking.md):
#
#   bash bench/h200_runs.sh PART [PART...]  # writes under $OUT (or /tmp/bole-runs)
#
# Several parts run in order and share BUDGET_S seconds (default 590, one device command): each
# step's time limit is its own or what is left, whichever is less, so a late part is cut, not the
# command. Parts with several sets take SET=...; one command runs one set.
#
#   tests       the compiled test suite in 8 shards (~4 min) -> $OUT/tests/summary.txt (kept as
#               bench/results/gpu-tests-<date>.txt)
#   linear      bench/linear.py, the 9B preset's projections at 1-16 rows, cuBLAS against each
#               tile (~3 min); ROWS=1: the same at 24-64 rows (tag -rows); FP8=1: FP8 weights,
#               the FP8 kernel's tiles at 1-64 rows against cuBLAS on bf16 (not yet run)
#   round       bole bench (bundled, batch 1 and 8), then bench/model_forward.py (9B) (~4.5 min)
#   e2e-9b      bench/e2e.py, Qwen3.5-9B, replayed qwen3-next-mtp acceptance, 32k draft
#               vocabulary, tree-serial tuned on its own (the README's headline):
#               SET=a batch 1 2, SET=b batch 4 16 (512-token requests, 4096 tokens a run; ~4 min
#               each), SET=c batch 32 64 (one wave of 128-token requests; ~5 min), SET=8 batch 8
#               (512-token requests; ~4 min), SET=confirm tree-serial's max batch at 8k context
#               run for a few rounds, SET=fp8 the qwen3.5-9b-fp8 preset at batch 1-8 (not yet run)
#   e2e-27b     bench/e2e.py, Qwen3.5-27B with bole-goodput: SET=b1-8 batch 8 1, SET=small
#               batch 16 4 2, SET=large batch 32, SET=b64 batch 64 (chain and tree-serial do not
#               fit: recorded so; warm-ups of 8 requests) (each ~3.5-5.5 min)
#   e2e-bundled bench/e2e.py, the bundled model with its MTP head at batch 1-64, tree-serial tuned
#               on its own, bole-goodput (~6 min)
#   budget-9b   bench/budget.py, the 9B preset at batches $BATCHES (default 64 32), every policy
#               with goodput-warm, the oracle chosen on held-out prompts, two waves a run, tag
#               -w$TAG (batch 64 ~5.5 min, 32 16 8 ~7 min, 4 2 1 ~2 min); SET=eps: the calibrated
#               policy alone at eps 0.1 and 0.42 (~4.5 min); SET=defaults: the serving default
#               tree (depth 6, top-4, 16 nodes) under the fixed and the goodput policy, batches
#               $BATCHES (default 1-64)
#   budget-bundled  the bundled model at batch 64-1 as budget-9b, each configuration three times
#               (the median kept), tag -w-r3$TAG (~7 min); SET=eps: the calibrated policy alone at
#               eps 0.1 and 0.7, three runs each; SET=defaults: as budget-9b's
#   moe         the MoE presets ($MODELS, default qwen3.5-35b-a3b): SET=forward: bench/model_forward.py
#               (decode and verify widths at batch 1 and 8, the touched experts' byte floor);
#               SET=e2e: bench/e2e.py at batches $BATCHES (default 1 8), every mode at the swept
#               shapes plus bole-goodput, replayed qwen3-next-mtp acceptance; SET=gemv: the
#               few-token MoE kernels' tiles (bench/tuning/moe_configs.py --gemv). $MODELS may be
#               an FP8 twin (qwen3.5-9b-fp8, qwen3-next-80b-a3b-fp8: one H200)
#   serve       bench/serve.py, all four modes behind bole serve (~5 min); ENGINE_PROCESS=1:
#               bole serve --engine-process; SET=prefix: bole with 8 shared 2k-token prefixes and
#               with unique ones, prefix cache on and off (neither yet run)
#   tp          bench/tp.py, 27B forwards and all-reduces at tp 1 and 2; SET=e2e: bench/e2e.py
#               --tp 2, 27B at batch 1 and 8 (nvidia-h200-x2; not yet run)
#
# Parts that time out keep what they finished (the scripts rewrite their JSON as they go).
set -u
parts="tests linear round e2e-9b e2e-27b e2e-bundled budget-9b budget-bundled moe serve tp"
parts=${parts//$'\n'/ }
[ $# -gt 0 ] || { echo "usage: bash bench/h200_runs.sh PART... (one of: $parts)" >&2; exit 2; }
for part in "$@"; do
  [[ " $parts " == *" $part "* ]] || { echo "unknown part $part (one of: $parts)" >&2; exit 2; }
done
out=${OUT:-/tmp/bole-runs}
mkdir -p "$out"
if [ -d .whl ]; then      # once per machine: a warm one keeps /tmp/site between commands
  [ -d /tmp/site/fla ] ||
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
# the commit the results name (the copy here may hold a .git of an older commit, so this stamp
# wins over git describe): before the call, `git describe --always --dirty --exclude="*" > .whl/COMMIT`
[ -f .whl/COMMIT ] && export BOLE_COMMIT=${BOLE_COMMIT:-$(cat .whl/COMMIT)}
vocab=(--draft-vocab 32768)
policy=(--budget-policies goodput)
deadline=$(( $(date +%s) + ${BUDGET_S:-590} ))

# A step's time limit: its own, or what is left of BUDGET_S when that is less.
lim() {
  local left=$(( deadline - $(date +%s) ))
  (( left < 1 )) && left=1
  echo $(( $1 < left ? $1 : left ))
}

need_set() { echo "part $1 needs SET=${2// /|}" >&2; exit 2; }

run_part() {
  local part=$1
case "$part" in
  tests)
    timeout $(lim 560) bash bench/gpu_tests.sh "$out/tests" 8 tests/ops tests/models tests/speculative \
      tests/engine tests/test_round_cuda.py tests/test_engine.py tests/test_forest.py > /dev/null
    head -20 "$out/tests/summary.txt" ;;
  linear)
    if [ -n "${FP8:-}" ]; then
      timeout $(lim 500) python3 bench/linear.py --fp8 --rows 1 8 32 64 --out "$out"
    elif [ -n "${ROWS:-}" ]; then
      timeout $(lim 400) python3 bench/linear.py --rows 24 32 48 64 --quick --tag=-rows --out "$out"
    else
      timeout $(lim 400) python3 bench/linear.py --out "$out"
    fi ;;
  round)
    timeout $(lim 150) python3 -m bole.cli bench --prompts 8 --batches 1 8 --max-tokens 256 --out "$out"
    timeout $(lim 400) python3 bench/model_forward.py --out "$out" ;;
  e2e-9b)
    local ts=(--models qwen3.5-9b --tune-tree-serial "${vocab[@]}" --out "$out")
    local long=(--max-tokens 512 --min-run-tokens 4096)
    case "${SET:-}" in
      a) timeout $(lim 585) python3 bench/e2e.py "${ts[@]}" "${long[@]}" --batches 1 2 \
           --chain-depths 6 8 --tree-shapes 4,2,8 8,2,16 8,4,32 --tag=-9b-ts-a ;;
      b) timeout $(lim 585) python3 bench/e2e.py "${ts[@]}" "${long[@]}" --batches 4 16 \
           --chain-depths 4 6 --tree-shapes 4,2,8 6,3,16 8,2,16 --tag=-9b-ts-b ;;
      c) timeout $(lim 585) python3 bench/e2e.py "${ts[@]}" --batches 32 64 --chain-depths 4 \
           --tree-shapes 4,2,8 6,3,16 --tag=-9b-ts-c ;;
      8) timeout $(lim 585) python3 bench/e2e.py "${ts[@]}" "${long[@]}" --batches 8 \
           --chain-depths 6 --tree-shapes 4,2,8 6,3,16 8,2,16 8,4,32 --tag=-9b-ts ;;
      confirm) timeout $(lim 585) python3 bench/e2e.py --models qwen3.5-9b --batches 1 \
           --chain-depths 4 --tree-shapes 8,4,32 "${vocab[@]}" --confirm-max-batch --out "$out" \
           --tag=-9b-confirm ;;
      fp8) timeout $(lim 585) python3 bench/e2e.py --models qwen3.5-9b-fp8 --batches 1 2 4 8 \
           --chain-depths 4 6 --tree-shapes 6,3,16 8,4,32 "${vocab[@]}" "${policy[@]}" \
           --out "$out" --tag=-9b-fp8 ;;
      *) need_set e2e-9b "a b c 8 confirm fp8" ;;
    esac ;;
  e2e-27b)
    local b=(--models qwen3.5-27b "${vocab[@]}" "${policy[@]}" --out "$out")
    case "${SET:-}" in
      b1-8) timeout $(lim 585) python3 bench/e2e.py "${b[@]}" --batches 8 1 --chain-depths 4 6 \
              --tree-shapes 6,3,16 8,2,16 8,4,32 --tag=-27b-b1-8 ;;
      small) timeout $(lim 585) python3 bench/e2e.py "${b[@]}" --batches 16 4 2 --chain-depths 4 6 \
              --tree-shapes 4,2,8 8,2,16 8,4,32 --tag=-27b-small ;;
      large) timeout $(lim 585) python3 bench/e2e.py "${b[@]}" --batches 32 --chain-depths 4 \
              --tree-shapes 4,2,8 6,3,16 --tag=-27b-large ;;
      b64) timeout $(lim 585) python3 bench/e2e.py "${b[@]}" --batches 64 --chain-depths 4 \
              --tree-shapes 4,2,8 6,3,16 --warmup-requests 8 --tag=-27b-b64 ;;
      *) need_set e2e-27b "b1-8 small large b64" ;;
    esac ;;
  e2e-bundled)
    timeout $(lim 585) python3 bench/e2e.py --models bundled --batches 1 2 4 8 16 32 64 \
      --chain-depths 3 4 6 --tree-shapes 4,2,8 6,3,16 8,4,32 --min-run-tokens 1024 \
      --tune-tree-serial "${policy[@]}" --out "$out" --tag=-bundled ;;
  budget-9b)
    case "${SET:-}" in
      eps) timeout $(lim 585) python3 bench/budget.py --models qwen3.5-9b \
             --batches ${BATCHES:-64 32 16 8 4 2 1} --policies calibrated --eps-sweep 0.42 --waves 2 \
             "${vocab[@]}" --out "$out" --tag=-w-eps ;;
      defaults) timeout $(lim 585) python3 bench/budget.py --models qwen3.5-9b \
             --batches ${BATCHES:-64 32 16 8 4 2 1} --depth 6 --topk 4 --budget 16 \
             --policies fixed goodput --waves 2 "${vocab[@]}" --out "$out" --tag=-defaults${TAG:-} ;;
      "") timeout $(lim 585) python3 bench/budget.py --models qwen3.5-9b --batches ${BATCHES:-64 32} \
             --sweep --sweep-widths --waves 2 "${vocab[@]}" --out "$out" --tag=-w${TAG:-} ;;
      *) need_set budget-9b "eps defaults (or none)" ;;
    esac ;;
  budget-bundled)
    case "${SET:-}" in
      eps) timeout $(lim 585) python3 bench/budget.py --models bundled \
             --batches ${BATCHES:-64 32 16 8 4 2 1} --policies calibrated --eps-sweep 0.7 --waves 2 \
             --repeats 3 --out "$out" --tag=-w-eps ;;
      defaults) timeout $(lim 585) python3 bench/budget.py --models bundled \
             --batches ${BATCHES:-64 32 16 8 4 2 1} --depth 6 --topk 4 --budget 16 \
             --policies fixed goodput --waves 2 --repeats 3 --out "$out" --tag=-defaults${TAG:-} ;;
      "") timeout $(lim 585) python3 bench/budget.py --models bundled --batches 64 32 16 8 4 2 1 \
             --sweep --sweep-widths --waves 2 --repeats 3 --out "$out" --tag=-w-r3${TAG:-} ;;
      *) need_set budget-bundled "eps defaults (or none)" ;;
    esac ;;
  moe)
    local models=(${MODELS:-qwen3.5-35b-a3b})
    case "${SET:-}" in
      forward) timeout $(lim 585) python3 bench/model_forward.py --preset "${models[0]}" \
                 --nodes 4 8 16 32 64 --batch-case 8 32 --sweep-batches 8 --out "$out" ;;
      e2e) timeout $(lim 585) python3 bench/e2e.py --models "${models[@]}" --batches ${BATCHES:-1 8} \
             --chain-depths 3 --tree-shapes 6,3,16 8,4,32 "${vocab[@]}" "${policy[@]}" \
             --out "$out" --tag=-${models[0]}${TAG:-} ;;
      gemv) timeout $(lim 585) python3 bench/tuning/moe_configs.py --preset "${models[0]}" \
              --gemv --tokens 1 2 3 4 6 8 --out "$out/moe-gemv-${models[0]}.json" ;;
      *) need_set moe "forward e2e gemv" ;;
    esac ;;
  serve)
    if [ "${SET:-}" = prefix ]; then       # the prefix cache: shared and unique prefixes, on and off
      local pre=(--modes bole --requests 128 --out "$out" --log-dir "$out/serve-logs")
      for w in shared unique; do
        timeout $(lim 140) python3 bench/serve.py "${pre[@]}" --workload $w-prefix --tag=-$w
        timeout $(lim 140) python3 bench/serve.py "${pre[@]}" --workload $w-prefix \
          --no-prefix-cache --tag=-$w-off
      done
    elif [ -n "${ENGINE_PROCESS:-}" ]; then
      timeout $(lim 580) python3 bench/serve.py --requests 512 --engine-process \
        --tag=-engine-process --out "$out" --log-dir "$out/serve-logs"
    else
      timeout $(lim 580) python3 bench/serve.py --requests 512 --out "$out" --log-dir "$out/serve-logs"
    fi ;;
  tp)
    if [ "${SET:-}" = e2e ]; then
      timeout $(lim 580) python3 bench/e2e.py --models qwen3.5-27b --batches 1 8 --tp 2 \
        --chain-depths 3 --tree-shapes 6,3,16 8,4,32 "${vocab[@]}" --out "$out" --tag=-27b-tp2
    else
      timeout $(lim 580) python3 bench/tp.py --out "$out"
    fi ;;
  *)
    echo "unknown part $part" >&2; exit 2 ;;
esac
}

for part in "$@"; do
  (( $(lim 590) > 5 )) || { echo "no time left for $part" >&2; break; }
  run_part "$part"
done
