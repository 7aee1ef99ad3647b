#!/usr/bin/env bash
# The measurement suite on a lent GPU, in parts that each fit the device tool's 10 minutes a
# command (times estimated from the H200 runs of 2026-12-01). Run one part per call, carrying
# .whl (bench/README.md):
#
#   bash bench/h200_runs.sh PART [PART...]  # writes under $OUT (or /tmp/bole-runs)
#
# Several parts run in order and share BUDGET_S seconds (default 590, one device command): each
# step's time limit is its own or what is left, whichever is less, so a late part is cut, not the
# command. LIMIT sets the e2e-27b-large and -b64 parts' own limit.
#
#   tests     the compiled test suite in 8 shards (~4 min)          -> $OUT/tests/summary.txt
#   round     bole bench (bundled, batch 1 and 8) and model_forward (9B) (~4.5 min)
#   e2e-9b-a  tests/ops/test_linear.py, then bench/e2e.py, 9B at batch 8 1 4 2 (chain depths 6 and
#             8, trees 7,2,14 8,2,16 8,4,32, 1024 tokens a run at least), with bole-goodput (~9 min)
#   e2e-9b-c  bench/e2e.py, 9B at batch 16 with chain depths 4 and 6, then batch 8 served in four
#             waves of 8 requests (32 in all, continuous batching) (~4 min)
#   e2e-9b-b  bench/e2e.py, 9B at batch 16 32 64 (the shapes that won there), with bole-goodput
#   e2e-27b   bench/e2e.py, 27B at batch 1 8 32, then tree-serial's max batch confirmed (~9 min)
#   confirm-9b  bench/e2e.py, 9B at batch 1 with the 8,4,32 tree, then tree-serial's max batch at
#             8k context run for a few rounds
#   linear    bench/linear.py: decode-shape linear layers, cuBLAS against bole's kernels (~3 min)
#   linear-rows  the same at 24-64 rows, past the dispatcher's 16 (not yet run)
#   budget-bundled  bench/budget.py, the bundled model at all 7 batches 1-64 (~3 min)
#   budget-9b bench/budget.py, the 9B preset at all 7 batches 1-64 (~7 min)
#   budget-both  budget-bundled, then the 9B preset with a two-point sweep (~9.5 min)
#   budget-9b-rest  the 9B preset at batch 2 4 64 32, the batches budget-both's 10 minutes left out
#             (~7 min with the 54 s calibration of a fresh machine)
#   waves-budget  bench/e2e.py, 9B at batch 8 in four waves of 8 requests (continuous batching),
#             then budget-bundled with the calibrated policy also at eps 0.25 0.5 1 2 (~7 min)
#   profile-waves  bench/round_profile.py (9B, batch 8, tree 8,2,16: each captured graph kernel
#             by kernel), then the 9B batch 8 in four waves (~8 min)
#   e2e-9b-d  the GPU tests of the replay kernel, the draft vocabulary's top-k and the verify's
#             in-place factors, then e2e-9b-a's study without bole-goodput (~9.5 min)
#   e2e-9b-e  the GPU tests of the conv commit's strided inputs and linear(out=), then 9B batch 8
#             (chain depth 6, tree 8,2,16, one wave) (~6 min)
#   e2e-9b-f  the GPU tests of the replay step kernel and linear(out=), then bench/e2e.py, 9B at
#             batch 8 1 4 2 with 512-token requests, 4096 tokens a run (chain depths 6 and 8,
#             trees 8,2,16 8,4,32; ~7 min)
#   e2e-9b-f16  bench/e2e.py, 9B at batch 16 with 512-token requests (chain depths 4 6, trees
#             4,2,8 6,3,16 8,2,16; one wave), the last batch of the chain target (~3 min)
#   budget-9b-h  the 9B preset at batch 2 8 16, oracle sweep 64-512, calibrated also at eps 0.25
#             0.5 1 (each run's acceptance estimates from the prior; not yet run)
#   e2e-9b-ts  bench/e2e.py, 9B at batch 8 and 1 with 512-token requests, tree-serial swept over
#             the tree shapes on its own (--tune-tree-serial; not yet run)
#   e2e-27b-small  bench/e2e.py, 27B at batch 16 4 2 (chain depths 4 6, trees 4,2,8 8,2,16
#             8,4,32, bole-goodput; ~5.5 min)
#   e2e-27b-large  27B at batch 32 64, one chain depth (4) and two trees (4,2,8 6,3,16: what
#             won at 9B there), bole-goodput (~4.5 min at batch 32; batch 64's chain does not fit)
#   e2e-27b-b64  27B at batch 64 alone: chain depth 4 (it does not fit: recorded so), trees
#             4,2,8 6,3,16, bole-goodput, warm-ups of 8 requests (each run's warm-up otherwise
#             prefills 64 x 2k tokens, about 20 s; ~4 min)
#   e2e-27b-b1-8  27B at batch 8 1 with bole-goodput, chain depths 4 6, trees 6,3,16 8,2,16
#             8,4,32 (~3.5 min)
#   e2e-9b-ts-a  9B at batch 1 2, 512-token requests, tree-serial tuned on its own
#   e2e-9b-ts-b  the same at batch 4 16 (4096 tokens a run; -a and -b ~8 min together)
#   e2e-9b-ts-c  9B at batch 32 64, tree-serial tuned over e2e-9b-b's two trees (128-token
#             requests; ~5 min)
#   e2e-ts-bundled  e2e-9b-ts at batch 8 alone (chain depth 6), then e2e-bundled (cut where
#             10 minutes end; ~6 min)
#   e2e-bundled-best  the bundled study with goodput on bole's best fixed tree at each batch
#             (--policy-tree best; tree-serial on bole's trees; not yet run)
#   e2e-bundled  bench/e2e.py, the bundled model with its MTP head at batch 1-64 (chain depths 3
#             4 6, trees 4,2,8 6,3,16 8,4,32 for bole and for tree-serial, bole-goodput, 1024
#             tokens a run; not yet run)
#   budget-9b-i  the 9B preset at batch 16 32 2, the oracle over the capacities that fill each
#             verify width (--sweep-widths), goodput choosing a width (~6 min)
#   budget-9b-j  the same at batch 8 64 4 1 (cut at 500 s: what is left of a session's device time)
#   budget-9b-k  the same at batch 64 1 4, the batches budget-9b-i and -j left (~6 min)
#   budget-9b-l  the same at batch 2 8 16 again: the could-widen gate and the width that
#             ignores rows near their token limit came after those runs (~4.5 min)
#   budget-9b-wk  the GPU tests of goodput's width choice in Triton (tests/speculative/
#             test_width_kernel.py, test_round_cuda.py -k captured_at_start), then the 9B preset
#             at batch 16 8 2 1 with BOLE_WIDTH_KERNEL=1 (goodput's choice in two launches, now the
#             default; the other policies do not use it) (~8 min)
#   budget-9b-wk2  the same preset and kernel at batch 4 32 64 (~7 min)
#   budget-9b-cal  the 9B preset, the calibrated policy alone (B_ver at its width's capacity,
#             each request capped at that width) at eps 0.1 0.15 0.42, batch 8 16 4 32 64 2 1
#             (compare with the oracles of budget-9b-wk and -wk2; batches 8 16 4 32 ran in 5.5 min)
#   budget-9b-cal-rest  the same at batch 64 2 1, the batches budget-9b-cal's time left (~4 min)
#   budget-9b-ho-a  the 9B preset at batch 64 32, every policy, the oracle's capacity chosen on
#             held-out prompts (--sweep-widths), two waves of requests a run (~7.5 min)
#   budget-9b-ho-b  the same at batch 16 8 4 (~5 min)
#   budget-ho-c  the same at batch 2 1, then the bundled model at batch 1-64 (~6 min)
#   budget-bundled-ho-r3  the bundled model at batch 64 32 16 8 4 2 1 as in budget-ho-c, each
#             configuration run three times (the median kept: its rounds of about 1 ms make a
#             run of 128-token requests last about 0.1 s; ~5 min)
#   budget-9b-w  the 9B preset at batches $BATCHES (default 64 32), every policy with
#             goodput-warm, the oracle chosen on held-out prompts (--sweep-widths), two waves a
#             run, file tag -w$TAG (batch 64 ~5.5 min, 32 16 8 ~7 min, 4 2 1 ~2 min)
#   budget-9b-w-eps  the 9B preset at batches $BATCHES (default 64 32 16 8 4 2 1), the
#             calibrated policy alone at eps 0.1 and 0.42 (its rates against budget-9b-w's
#             oracle: bench/budget.py --eps-table; ~4.5 min with a fresh machine's calibration)
#   budget-bundled-w-r3  the bundled model at batch 64 32 16 8 4 2 1 as in budget-9b-w (tag
#             -w-r3$TAG), each configuration run three times (the median kept; ~4 min, ~7 with
#             goodput's draft graph per depth captured for each run)
#   budget-bundled-w-eps  the bundled model at batches $BATCHES (default 64 32 16 8 4 2 1), the
#             calibrated policy alone at eps 0.1 and 0.7, three runs each (its rates against
#             budget-bundled-w-r3's oracle: bench/budget.py --eps-table)
#   budget-bundled-r3  bench/attention_splits.py (tree attention's context splits, a probe), then
#             bench/budget.py, the bundled model at batch 8 64 1 16 2 4 32, each configuration
#             run three times (the median kept; cut where 10 minutes end)
#   budget-9b-g  the 9B preset at batch 64 32 2 16 with an oracle sweep of 64 128 256 512 (cut
#             where 10 minutes end)
#   budget-9b-short  the 9B preset at batch 2 and 4 with the calibrated policy also at eps 0.5
#             and 1 (~7 min with the calibration of a fresh machine)
#   budget-9b-eps  the 9B preset at batch 2 4 64 32 1 8 16 with the calibrated policy also at eps
#             0.25 0.5 1 (a fresh machine calibrates first: 54 s; cut where 10 minutes end)
#   serve     bench/serve.py, all four modes (~5 min)
#   serve-process  the same with bole serve --engine-process (not yet run)
#   tp        bench/tp.py: 27B forwards and all-reduces at tp 1 and 2 (nvidia-h200-x2; not yet run)
#   tp-e2e    bench/e2e.py --tp 2: 27B at batch 1 and 8 (nvidia-h200-x2; not yet run)
#
# Parts that time out keep what they finished (the scripts rewrite their JSON as they go).
set -u
parts="tests linear linear-rows round e2e-9b-a e2e-9b-b e2e-9b-c e2e-27b confirm-9b waves-budget
profile-waves e2e-9b-d e2e-9b-e e2e-9b-f e2e-9b-f16 e2e-9b-ts e2e-27b-small e2e-27b-large
e2e-27b-b64 e2e-27b-b1-8 e2e-9b-ts-a e2e-9b-ts-b e2e-9b-ts-c e2e-ts-bundled e2e-bundled-best
e2e-bundled budget-bundled-r3 budget-9b-g budget-9b-i budget-9b-j budget-9b-k budget-9b-l
budget-9b-wk budget-9b-wk2 budget-9b-cal budget-9b-cal-rest budget-9b-ho-a budget-9b-ho-b
budget-ho-c budget-bundled-ho-r3 budget-9b-w budget-9b-w-eps budget-bundled-w-r3 budget-bundled-w-eps budget-9b-h budget-9b-short budget-9b-eps budget-bundled budget-9b budget-both
budget-9b-rest serve serve-process tp tp-e2e"
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
shapes=(--chain-depths 3 4 --tree-shapes 4,2,8 6,3,16 8,4,32 --draft-vocab 32768)
policy=(--budget-policies goodput)
deadline=$(( $(date +%s) + ${BUDGET_S:-590} ))

# A step's time limit: its own, or what is left of BUDGET_S when that is less.
lim() {
  local left=$(( deadline - $(date +%s) ))
  (( left < 1 )) && left=1
  echo $(( $1 < left ? $1 : left ))
}

run_part() {
  local part=$1
case "$part" in
  tests)
    timeout $(lim 560) bash bench/gpu_tests.sh "$out/tests" 8 tests/ops tests/models tests/speculative \
      tests/engine tests/test_round_cuda.py tests/test_engine.py tests/test_forest.py > /dev/null
    head -20 "$out/tests/summary.txt" ;;
  linear)
    timeout $(lim 400) python3 bench/linear.py --out "$out" ;;
  linear-rows)
    timeout $(lim 400) python3 bench/linear.py --rows 24 32 48 64 --quick --tag=-rows --out "$out" ;;
  round)
    timeout $(lim 150) python3 -m bole.cli bench --prompts 8 --batches 1 8 --max-tokens 256 --out "$out"
    timeout $(lim 400) python3 bench/model_forward.py --out "$out" ;;
  e2e-9b-a)
    timeout $(lim 70) python3 -m pytest -q -p no:cacheprovider tests/ops/test_linear.py \
      > "$out/test-linear.txt" 2>&1; tail -2 "$out/test-linear.txt"
    timeout $(lim 510) python3 bench/e2e.py --models qwen3.5-9b --batches 8 1 4 2 --chain-depths 6 8 \
      --tree-shapes 7,2,14 8,2,16 8,4,32 --min-run-tokens 1024 --draft-vocab 32768 \
      "${policy[@]}" --out "$out" --tag=-9b-a ;;
  e2e-9b-c)
    timeout $(lim 170) python3 bench/e2e.py --models qwen3.5-9b --batches 16 --chain-depths 4 6 \
      --tree-shapes 4,2,8 6,3,16 --min-run-tokens 1024 --draft-vocab 32768 --out "$out" \
      --tag=-9b-b16
    timeout $(lim 150) python3 bench/e2e.py --models qwen3.5-9b --batches 8 --chain-depths 6 \
      --tree-shapes 8,2,16 --min-run-tokens 4096 --draft-vocab 32768 --out "$out" \
      --tag=-9b-b8-waves ;;
  e2e-9b-b)
    timeout $(lim 580) python3 bench/e2e.py --models qwen3.5-9b --batches 16 32 64 --chain-depths 4 \
      --tree-shapes 4,2,8 6,3,16 --draft-vocab 32768 "${policy[@]}" \
      --out "$out" --tag=-9b-b ;;
  e2e-27b)
    timeout $(lim 580) python3 bench/e2e.py --models qwen3.5-27b --batches 1 8 32 "${shapes[@]}" \
      --confirm-max-batch --out "$out" --tag=-27b ;;
  confirm-9b)
    timeout $(lim 580) python3 bench/e2e.py --models qwen3.5-9b --batches 1 --chain-depths 4 \
      --tree-shapes 8,4,32 --draft-vocab 32768 --confirm-max-batch --out "$out" --tag=-9b-confirm ;;
  budget-bundled)
    timeout $(lim 580) python3 bench/budget.py --models bundled --batches 1 2 4 8 16 32 64 \
      --sweep 64 256 1024 2048 --out "$out" ;;
  budget-9b)
    timeout $(lim 580) python3 bench/budget.py --models qwen3.5-9b --batches 1 2 4 8 16 32 64 \
      --sweep 64 256 1024 --draft-vocab 32768 --out "$out" ;;
  budget-both)
    timeout $(lim 185) python3 bench/budget.py --models bundled --batches 1 2 4 8 16 32 64 \
      --sweep 64 256 1024 2048 --out "$out"
    timeout $(lim 395) python3 bench/budget.py --models qwen3.5-9b --batches 8 16 1 64 2 4 32 \
      --sweep 64 256 --draft-vocab 32768 --out "$out" ;;
  budget-9b-rest)
    timeout $(lim 580) python3 bench/budget.py --models qwen3.5-9b --batches 2 4 64 32 \
      --sweep 64 256 --draft-vocab 32768 --out "$out" --tag=-rest ;;
  waves-budget)
    timeout $(lim 150) python3 bench/e2e.py --models qwen3.5-9b --batches 8 --chain-depths 6 \
      --tree-shapes 8,2,16 --min-run-tokens 4096 --draft-vocab 32768 --out "$out" \
      --tag=-9b-b8-waves
    timeout $(lim 380) python3 bench/budget.py --models bundled --batches 1 2 4 8 16 32 64 \
      --sweep 64 256 1024 2048 --eps-sweep 0.25 0.5 1 2 --out "$out" --tag=-eps ;;
  profile-waves)
    timeout $(lim 200) python3 bench/round_profile.py --batch 8 --tree 8,2,16 --draft-vocab 32768 \
      --out "$out" | tail -8
    timeout $(lim 360) python3 bench/e2e.py --models qwen3.5-9b --batches 8 --chain-depths 6 \
      --tree-shapes 8,2,16 --min-run-tokens 4096 --draft-vocab 32768 --out "$out" \
      --tag=-9b-b8-waves ;;
  e2e-9b-d)
    timeout $(lim 110) python3 -m pytest -q -p no:cacheprovider tests/speculative/test_replay_kernel.py \
      tests/ops/test_topk_softmax.py tests/ops/test_gdn_triton_verify.py -k "factors or ids or \
      kernel_proposes or shapes_are or matches_definition" > "$out/test-d.txt" 2>&1
    tail -2 "$out/test-d.txt"
    timeout $(lim 470) python3 bench/e2e.py --models qwen3.5-9b --batches 8 1 4 2 --chain-depths 6 8 \
      --tree-shapes 7,2,14 8,2,16 8,4,32 --min-run-tokens 1024 --draft-vocab 32768 \
      --out "$out" --tag=-9b-d ;;
  e2e-9b-e)
    timeout $(lim 120) python3 -m pytest -q -p no:cacheprovider tests/ops/test_commit_rows.py \
      tests/ops/test_linear.py tests/models/test_runtime_vs_transformers.py -k "conv or out or \
      triton" > "$out/test-e.txt" 2>&1
    tail -2 "$out/test-e.txt"
    timeout $(lim 300) python3 bench/e2e.py --models qwen3.5-9b --batches 8 --chain-depths 6 \
      --tree-shapes 8,2,16 --min-run-tokens 1024 --draft-vocab 32768 --out "$out" \
      --tag=-9b-b8-e ;;
  e2e-9b-f)
    timeout $(lim 100) python3 -m pytest -q -p no:cacheprovider tests/speculative/test_replay_kernel.py \
      tests/ops/test_linear.py > "$out/test-f.txt" 2>&1
    tail -2 "$out/test-f.txt"
    timeout $(lim 480) python3 bench/e2e.py --models qwen3.5-9b --batches 8 1 4 2 --chain-depths 6 8 \
      --tree-shapes 8,2,16 8,4,32 --max-tokens 512 --min-run-tokens 4096 --draft-vocab 32768 \
      --out "$out" --tag=-9b-f ;;
  e2e-9b-f16)
    timeout $(lim 580) python3 bench/e2e.py --models qwen3.5-9b --batches 16 --chain-depths 4 6 \
      --tree-shapes 4,2,8 6,3,16 8,2,16 --max-tokens 512 --min-run-tokens 8192 \
      --draft-vocab 32768 --out "$out" --tag=-9b-f16 ;;
  budget-9b-h)
    timeout $(lim 585) python3 bench/budget.py --models qwen3.5-9b --batches 2 8 16 \
      --sweep 64 128 256 512 --eps-sweep 0.25 0.5 1 --draft-vocab 32768 --out "$out" --tag=-h ;;
  e2e-9b-ts)
    timeout $(lim 585) python3 bench/e2e.py --models qwen3.5-9b --batches 8 1 --chain-depths 6 8 \
      --tree-shapes 4,2,8 6,3,16 8,2,16 8,4,32 --tune-tree-serial --max-tokens 512 \
      --min-run-tokens 4096 --draft-vocab 32768 --out "$out" --tag=-9b-ts ;;
  e2e-27b-small)
    timeout $(lim 585) python3 bench/e2e.py --models qwen3.5-27b --batches 16 4 2 --chain-depths 4 6 \
      --tree-shapes 4,2,8 8,2,16 8,4,32 --draft-vocab 32768 "${policy[@]}" --out "$out" \
      --tag=-27b-small ;;
  e2e-27b-large)
    timeout $(lim ${LIMIT:-585}) python3 bench/e2e.py --models qwen3.5-27b --batches ${BATCHES:-32 64} \
      --chain-depths 4 --tree-shapes 4,2,8 6,3,16 --draft-vocab 32768 "${policy[@]}" \
      --out "$out" --tag=-27b-large ;;
  e2e-27b-b64)
    timeout $(lim ${LIMIT:-585}) python3 bench/e2e.py --models qwen3.5-27b --batches 64 \
      --chain-depths 4 --tree-shapes 4,2,8 6,3,16 --draft-vocab 32768 "${policy[@]}" \
      --warmup-requests 8 --out "$out" --tag=-27b-b64 ;;
  e2e-27b-b1-8)
    timeout $(lim 585) python3 bench/e2e.py --models qwen3.5-27b --batches 8 1 --chain-depths 4 6 \
      --tree-shapes 6,3,16 8,2,16 8,4,32 --draft-vocab 32768 "${policy[@]}" --out "$out" \
      --tag=-27b-b1-8 ;;
  e2e-9b-ts-a)
    timeout $(lim 585) python3 bench/e2e.py --models qwen3.5-9b --batches 1 2 --chain-depths 6 8 \
      --tree-shapes 4,2,8 8,2,16 8,4,32 --tune-tree-serial --max-tokens 512 \
      --min-run-tokens 4096 --draft-vocab 32768 --out "$out" --tag=-9b-ts-a ;;
  e2e-9b-ts-b)
    timeout $(lim 585) python3 bench/e2e.py --models qwen3.5-9b --batches 4 16 --chain-depths 4 6 \
      --tree-shapes 4,2,8 6,3,16 8,2,16 --tune-tree-serial --max-tokens 512 \
      --min-run-tokens 4096 --draft-vocab 32768 --out "$out" --tag=-9b-ts-b ;;
  e2e-9b-ts-c)
    timeout $(lim 585) python3 bench/e2e.py --models qwen3.5-9b --batches 32 64 --chain-depths 4 \
      --tree-shapes 4,2,8 6,3,16 --tune-tree-serial --draft-vocab 32768 --out "$out" \
      --tag=-9b-ts-c ;;
  e2e-ts-bundled)
    timeout $(lim 230) python3 bench/e2e.py --models qwen3.5-9b --batches 8 --chain-depths 6 \
      --tree-shapes 4,2,8 6,3,16 8,2,16 8,4,32 --tune-tree-serial --max-tokens 512 \
      --min-run-tokens 4096 --draft-vocab 32768 --out "$out" --tag=-9b-ts
    timeout $(lim 340) python3 bench/e2e.py --models bundled --batches 1 2 4 8 16 32 64 \
      --chain-depths 3 4 6 --tree-shapes 4,2,8 6,3,16 8,4,32 --min-run-tokens 1024 \
      --tune-tree-serial "${policy[@]}" --out "$out" --tag=-bundled ;;
  e2e-bundled-best)
    timeout $(lim 585) python3 bench/e2e.py --models bundled --batches 1 2 4 8 16 32 64 \
      --chain-depths 3 4 --tree-shapes 4,2,8 6,3,16 8,4,32 --min-run-tokens 1024 \
      "${policy[@]}" --policy-tree best --out "$out" --tag=-bundled-best ;;
  e2e-bundled)
    timeout $(lim 585) python3 bench/e2e.py --models bundled --batches 1 2 4 8 16 32 64 \
      --chain-depths 3 4 6 --tree-shapes 4,2,8 6,3,16 8,4,32 --min-run-tokens 1024 \
      --tune-tree-serial "${policy[@]}" --out "$out" --tag=-bundled ;;
  budget-9b-i)
    timeout $(lim 585) python3 bench/budget.py --models qwen3.5-9b --batches 16 32 2 --sweep \
      --sweep-widths --draft-vocab 32768 --out "$out" --tag=-i ;;
  budget-9b-j)
    timeout $(lim 500) python3 bench/budget.py --models qwen3.5-9b --batches 8 64 4 1 --sweep \
      --sweep-widths --draft-vocab 32768 --out "$out" --tag=-j ;;
  budget-9b-l)
    timeout $(lim 585) python3 bench/budget.py --models qwen3.5-9b --batches 2 8 16 --sweep \
      --sweep-widths --draft-vocab 32768 --out "$out" --tag=-l ;;
  budget-9b-wk)
    timeout $(lim 150) python3 -m pytest -q -p no:cacheprovider tests/speculative/test_width_kernel.py \
      tests/test_round_cuda.py -k "chooses or asked or ties or captured_at_start" \
      > "$out/test-wk.txt" 2>&1
    tail -2 "$out/test-wk.txt"
    BOLE_WIDTH_KERNEL=1 timeout $(lim 430) python3 bench/budget.py --models qwen3.5-9b \
      --batches 16 8 2 1 --sweep --sweep-widths --draft-vocab 32768 --out "$out" --tag=-wk ;;
  budget-9b-wk2)
    BOLE_WIDTH_KERNEL=1 timeout $(lim 585) python3 bench/budget.py --models qwen3.5-9b \
      --batches 4 32 64 --sweep --sweep-widths --draft-vocab 32768 --out "$out" --tag=-wk2 ;;
  budget-9b-cal)
    timeout $(lim 585) python3 bench/budget.py --models qwen3.5-9b --batches 8 16 4 32 64 2 1 \
      --policies calibrated --eps-sweep 0.15 0.42 --draft-vocab 32768 --out "$out" --tag=-cal ;;
  budget-9b-cal-rest)
    timeout $(lim 585) python3 bench/budget.py --models qwen3.5-9b --batches 64 2 1 \
      --policies calibrated --eps-sweep 0.15 0.42 --draft-vocab 32768 --out "$out" \
      --tag=-cal-rest ;;
  budget-9b-ho-a)
    timeout $(lim 585) python3 bench/budget.py --models qwen3.5-9b --batches 64 32 --sweep \
      --sweep-widths --waves 2 --draft-vocab 32768 --out "$out" --tag=-ho-a ;;
  budget-9b-ho-b)
    timeout $(lim 585) python3 bench/budget.py --models qwen3.5-9b --batches 16 8 4 --sweep \
      --sweep-widths --waves 2 --draft-vocab 32768 --out "$out" --tag=-ho-b ;;
  budget-ho-c)
    timeout $(lim 250) python3 bench/budget.py --models qwen3.5-9b --batches 2 1 --sweep \
      --sweep-widths --waves 2 --draft-vocab 32768 --out "$out" --tag=-ho-c
    timeout $(lim 330) python3 bench/budget.py --models bundled --batches 8 64 1 16 2 4 32 \
      --sweep --sweep-widths --waves 2 --out "$out" --tag=-ho ;;
  budget-bundled-ho-r3)
    timeout $(lim 585) python3 bench/budget.py --models bundled --batches 64 32 16 8 4 2 1 \
      --sweep --sweep-widths --waves 2 --repeats 3 --out "$out" --tag=-ho-r3 ;;
  budget-9b-w)
    timeout $(lim 585) python3 bench/budget.py --models qwen3.5-9b --batches ${BATCHES:-64 32} \
      --sweep --sweep-widths --waves 2 --draft-vocab 32768 --out "$out" --tag=-w${TAG:-} ;;
  budget-9b-w-eps)
    timeout $(lim 585) python3 bench/budget.py --models qwen3.5-9b \
      --batches ${BATCHES:-64 32 16 8 4 2 1} --policies calibrated --eps-sweep 0.42 --waves 2 --draft-vocab 32768 --out "$out" \
      --tag=-w-eps ;;
  budget-bundled-w-eps)
    timeout $(lim 585) python3 bench/budget.py --models bundled \
      --batches ${BATCHES:-64 32 16 8 4 2 1} --policies calibrated --eps-sweep 0.7 --waves 2 \
      --repeats 3 --out "$out" --tag=-w-eps ;;
  budget-bundled-w-r3)
    timeout $(lim 585) python3 bench/budget.py --models bundled --batches 64 32 16 8 4 2 1 \
      --sweep --sweep-widths --waves 2 --repeats 3 --out "$out" --tag=-w-r3${TAG:-} ;;
  budget-9b-k)
    timeout $(lim 585) python3 bench/budget.py --models qwen3.5-9b --batches 64 1 4 --sweep \
      --sweep-widths --draft-vocab 32768 --out "$out" --tag=-k ;;
  budget-bundled-r3)
    timeout $(lim 70) python3 bench/attention_splits.py --out "$out" | tail -3
    timeout $(lim 510) python3 bench/budget.py --models bundled --batches 8 64 1 16 2 4 32 \
      --sweep 256 1024 2048 --repeats 3 --out "$out" --tag=-r3 ;;
  budget-9b-g)
    timeout $(lim 585) python3 bench/budget.py --models qwen3.5-9b --batches 64 32 2 16 \
      --sweep 64 128 256 512 --draft-vocab 32768 --out "$out" --tag=-g ;;
  budget-9b-short)
    timeout $(lim 420) python3 bench/budget.py --models qwen3.5-9b --batches 2 4 --sweep 64 256 \
      --eps-sweep 0.5 1 --draft-vocab 32768 --out "$out" --tag=-short ;;
  budget-9b-eps)
    timeout $(lim 585) python3 bench/budget.py --models qwen3.5-9b --batches 2 4 64 32 1 8 16 \
      --sweep 64 256 --eps-sweep 0.25 0.5 1 --draft-vocab 32768 --out "$out" --tag=-eps ;;
  tp)
    timeout $(lim 580) python3 bench/tp.py --out "$out" ;;
  tp-e2e)
    timeout $(lim 580) python3 bench/e2e.py --models qwen3.5-27b --batches 1 8 --tp 2 \
      --chain-depths 3 --tree-shapes 6,3,16 8,4,32 --draft-vocab 32768 --out "$out" --tag=-27b-tp2 ;;
  serve)
    timeout $(lim 580) python3 bench/serve.py --requests 512 --out "$out" --log-dir "$out/serve-logs" ;;
  serve-process)
    timeout $(lim 580) python3 bench/serve.py --requests 512 --engine-process --tag=-engine-process \
      --out "$out" --log-dir "$out/serve-logs" ;;
  *)
    echo "unknown part $part" >&2; exit 2 ;;
esac
}

for part in "$@"; do
  (( $(lim 590) > 5 )) || { echo "no time left for $part" >&2; break; }
  run_part "$part"
done
