"""Whole-model forwards and rounds at real shapes, eager and captured in CUDA graphs, against the
weight-read and matmul floors.

For a preset (default Qwen3.5-9B, bf16, random weights with a random one-layer MTP head) with
every request at --context committed tokens:
  decode        one token per request (batch 1), GDN by the closed form (as bole's plain rounds)
  decode-inplace  the same, GDN states updated in place (as ar runs it: no GDN commit after it)
  decode-inplace-splitK  the same with tree attention's context splits of at least K keys
  verify-T      one T-node tree per request, depth 8 (batch 1, T from --nodes)
  verify-BxT    batch 16 x 32 nodes (--batch-case)
each eager and captured; the captured forward's GPU kernel time and kernel count come from the
profiler, its wall time from device events over replays. Then a whole bole round at batch 1
(the MTP head drafting a depth-8, top-4 tree of 64 nodes, verification, acceptance, commit), with
its split. Floors: the weights a forward reads over the measured copy bandwidth, and its matrix
products at 600 TFLOP/s. For a mixture-of-experts preset the weight floor counts, per MoE layer,
only the experts the forward's routing touches (counted on the device in an untimed forward over
the same tokens: the timed forwards make no extra sync), reported as touched_experts (mean per
MoE layer) and moe_weight_gb; --sweep-batches B... adds verify-BxT for every T of --nodes. The
whole rounds' floors leave the experts out (marked weight_floor_without_experts).

    python bench/model_forward.py --preset qwen3.5-35b-a3b --nodes 4 8 16 32 64 --sweep-batches 1 8

    python bench/model_forward.py                         # on a GPU -> bench/results/model-forward-<date>-<preset>.{json,png}
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
# Run by path, Python puts bench/ first on sys.path: drop it, so that bench's modules are reached
# as bench.<name> and can never shadow, or be shadowed by, an installed package of the same name.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench")]

from bole.engine import Engine, SamplingParams, SpecConfig  # noqa: E402
from bole.engine.runner import ModelRunner  # noqa: E402
from bole.ops import attention  # noqa: E402
from bole.forest import DenseForest  # noqa: E402
from bole.models.presets import preset_config  # noqa: E402
from bole.models.moe_layer import ALL_GATE_UP  # noqa: E402
from bole.ops.fp8 import Fp8Weight, StackedWeight  # noqa: E402
from bole.models.qwen3_hybrid import HybridModel  # noqa: E402
from bole.tree import DraftTree, PackedForest  # noqa: E402

from bench.harness import save_png  # noqa: E402

MATMUL_TFLOPS = 600.0


def copy_bandwidth(device) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    x = torch.empty(2 ** 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (start.elapsed_time(end) / 1e3)


def _is_view(t) -> bool:
    return (t.q if isinstance(t, Fp8Weight) else t)._base is not None


def _bytes_params(t) -> tuple[int, int]:
    if isinstance(t, Fp8Weight):
        return t.nbytes(), t.q.numel()
    return t.numel() * t.element_size(), t.numel()


def weight_bytes(model: HybridModel, prefix: str = "") -> tuple[int, int]:
    """(bytes, matrix parameters) of the weights a forward reads: every 2-D weight once
    (the fused projections, not their views; FP8 weights at one byte plus their scales), the
    embedding only as the tied lm_head. Stacked MoE experts (3-D) are left out:
    :func:`touched_expert_bytes` counts the ones a forward reads."""
    total, params = 0, 0
    embed = f"{model.config.weight_prefix}embed_tokens.weight"
    for name, t in model.w.items():
        if not name.startswith(prefix):
            continue
        if name == embed and not model.config.tie_word_embeddings:
            continue
        # a fused projection's parts are views of it: count the fused weight once
        for part in (t.parts if isinstance(t, StackedWeight) else [t]):
            if part.dim() != 2 or _is_view(part):
                continue
            b, n = _bytes_params(part)
            total += b
            params += n
    return total, params


def touched_expert_bytes(model: HybridModel, fwd) -> tuple[int, float, int]:
    """(bytes of the expert weights one call of ``fwd`` reads, mean experts touched per MoE
    layer, parameters of one expert summed over the MoE layers): every MoE layer's routing
    marks its experts on the device, read back once after the call. A shared expert merged
    into the kernels' tensors (:mod:`bole.models.moe_layer`) is one of them, touched always."""
    from bole.models.moe_layer import expert_weights
    if not model.config.num_experts:
        return 0, 0.0, 0
    hits: list[tuple[str, torch.Tensor]] = []
    routing = model.moe_routing

    def counting(x, p):
        weights, ids, shared = routing(x, p)
        hit = torch.zeros(expert_weights(model.w, p)[0].shape[0], dtype=torch.int64,
                          device=ids.device)
        hits.append((p, hit.scatter_(0, ids.reshape(-1).long(), 1)))
        return weights, ids, shared
    model.moe_routing = counting
    try:
        fwd()
    finally:
        del model.moe_routing
    counts = torch.stack([h for _, h in hits]).sum(1).tolist()
    total, params = 0, 0
    for (p, _), n in zip(hits, counts):
        w13, w2 = expert_weights(model.w, p)
        b13, n13 = _bytes_params(w13)
        b2, n2 = _bytes_params(w2)
        E = w13.shape[0]
        total += n * (b13 + b2) // E
        params += (n13 + n2) // E
    return total, sum(counts) / max(len(counts), 1), params


def events_ms(fn, reps: int) -> float:
    """Median device time of ``fn`` over ``reps`` calls (after warm-up)."""
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def kernel_profile(fn, top: int = 12) -> tuple[float, int, list]:
    """(GPU kernel ms, kernel count, the ``top`` kernel names by summed time as [name, us,
    launches]) of one call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    by_name: dict[str, list] = {}
    for e in kernels:
        entry = by_name.setdefault(e.name[:80], [e.name[:80], 0.0, 0])
        entry[1] += e.device_time
        entry[2] += 1
    ranked = sorted(by_name.values(), key=lambda r: -r[1])[:top]
    return sum(e.device_time for e in kernels) / 1e3, len(kernels), \
        [[n, round(us, 1), c] for n, us, c in ranked]


def forward_case(runner: ModelRunner, name: str, trees: list[DraftTree], slots: list[int],
                 vocab: int, reps: int, floor: dict, gdn: str | None = None) -> list[dict]:
    """Eager and captured timing of one forward over ``trees`` (one per slot); ``gdn``: the
    GDN backend (default the runner's)."""
    dev = runner.device
    dense = DenseForest.from_packed(PackedForest.pack(trees), device=dev)
    tokens = torch.randint(0, vocab, (dense.num_nodes,), device=dev)
    slot_t = torch.tensor(slots, dtype=torch.int32, device=dev)

    def fwd():
        forest = DenseForest.from_parents(dense.parents, dense.valid, dense.max_depth)
        return runner.forward(runner.make_batch(tokens, forest, slot_t, gdn))
    for _ in range(2):
        fwd()
    torch.cuda.synchronize()
    moe_bytes, touched, expert_params = touched_expert_bytes(runner.model, fwd)
    records = []
    eager_ms = events_ms(fwd, reps)
    k_ms, k_n, _ = kernel_profile(fwd)
    records.append(dict(case=name, captured=False, total_ms=eager_ms, kernel_ms=k_ms, kernels=k_n))
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fwd()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        fwd()
    torch.cuda.synchronize()
    cap_ms = events_ms(graph.replay, reps)
    k_ms, k_n, top = kernel_profile(graph.replay)
    records.append(dict(case=name, captured=True, total_ms=cap_ms, kernel_ms=k_ms, kernels=k_n,
                        top_kernels=top))
    nodes = dense.num_nodes
    # every node multiplies the 2-D weights and, per MoE layer, top-k experts' weights
    merged = any(n.endswith(ALL_GATE_UP) for n in runner.model.w)      # + the shared expert
    expert_slots = runner.model.config.num_experts_per_tok + merged
    matmul_params = floor["params"] + expert_slots * expert_params
    for r in records:
        r.update(nodes=nodes, batch=len(slots),
                 weight_floor_ms=floor["weights_ms"] + moe_bytes / floor["bandwidth"] * 1e3,
                 matmul_floor_ms=2 * matmul_params * nodes / (MATMUL_TFLOPS * 1e12) * 1e3)
        if runner.model.config.num_experts:
            r.update(touched_experts=touched, moe_weight_gb=moe_bytes / 1e9)
        r["floor_ms"] = max(r["weight_floor_ms"], r["matmul_floor_ms"])
        print(json.dumps(r), flush=True)
    del graph
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3.5-9b")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--nodes", type=int, nargs="+", default=[64])
    ap.add_argument("--batch-case", type=int, nargs=2, default=[16, 32], metavar=("BATCH", "NODES"))
    ap.add_argument("--sweep-batches", type=int, nargs="*", default=[],
                    help="also time verify-BxT for each of these batches B and each T of --nodes")
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--round-tokens", type=int, default=48)
    ap.add_argument("--draft-vocab", type=int, default=32768,
                    help="also time a bole round whose MTP head drafts over this many tokens "
                         "(EAGLE-3's reduced draft vocabulary; 0: skip)")
    ap.add_argument("--min-split-keys", type=int, nargs="*", default=[64],
                    help="also time decode-inplace with tree attention's context splits this "
                         "short (bole.ops.attention.MIN_SPLIT_KEYS; more programs at batch 1)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("model_forward.py times CUDA graphs: it needs a GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    config = preset_config(args.preset)
    model = HybridModel.random(config, dtype=torch.bfloat16, device=dev, mtp=True)
    bw = copy_bandwidth(dev)
    wbytes, params = weight_bytes(model)
    wbytes -= weight_bytes(model, "mtp.")[0]
    params -= weight_bytes(model, "mtp.")[1]
    floor = dict(weights_ms=wbytes / bw * 1e3, params=params, bandwidth=bw)
    print(json.dumps(dict(copy_bandwidth_tb_s=bw / 1e12, weight_gb=wbytes / 1e9,
                          weight_floor_ms=floor["weights_ms"])), flush=True)
    B, Tb = args.batch_case
    scratch = max(args.nodes + [Tb, args.depth + 1])
    runner = ModelRunner(model, model.new_cache(max([B] + args.sweep_batches),
                                                args.context + scratch + 8), "triton")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (args.context,), generator=gen)
    slots = [runner.cache.allocate(args.context + scratch)
             for _ in range(max([B] + args.sweep_batches))]
    t0 = time.perf_counter()
    runner.prefill(slots[0], prompt)
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    for s in slots[1:]:                          # the same committed context in every slot
        runner.cache.copy_slot(slots[0], s)
    rng = np.random.default_rng(0)
    records = forward_case(runner, "decode", [DraftTree.chain(1)], slots[:1], config.vocab_size,
                           args.reps, floor)
    # plain decoding as ar runs it: GDN states updated in place (bole/ops/gdn/decode.py)
    records += forward_case(runner, "decode-inplace", [DraftTree.chain(1)], slots[:1],
                            config.vocab_size, args.reps, floor, gdn="triton-decode")
    default_split = attention.MIN_SPLIT_KEYS
    for keys in args.min_split_keys:
        attention.MIN_SPLIT_KEYS = keys
        try:
            records += forward_case(runner, f"decode-inplace-split{keys}", [DraftTree.chain(1)],
                                    slots[:1], config.vocab_size, args.reps, floor,
                                    gdn="triton-decode")
        finally:
            attention.MIN_SPLIT_KEYS = default_split
    for T in args.nodes:
        tree = DraftTree.random(T, args.depth, rng)
        records += forward_case(runner, f"verify-{T}", [tree], slots[:1], config.vocab_size,
                                args.reps, floor)
    trees = [DraftTree.random(Tb, args.depth, rng) for _ in range(B)]
    records += forward_case(runner, f"verify-{B}x{Tb}", trees, slots[:B], config.vocab_size,
                            args.reps, floor)
    for b in args.sweep_batches:
        for T in args.nodes:
            trees = [DraftTree.random(T, min(args.depth, T), rng) for _ in range(b)]
            records += forward_case(runner, f"verify-{b}x{T}", trees, slots[:b],
                                    config.vocab_size, args.reps, floor)
    del runner
    torch.cuda.empty_cache()
    # a whole bole round at batch 1: MTP drafting, verification, acceptance, commit
    reduced = 0 < args.draft_vocab < config.vocab_size      # else the head drafts over all
    rounds = [("ar", 0), ("bole", 0)] + ([("bole", args.draft_vocab)] if reduced else [])
    for mode, draft_vocab in rounds:
        spec = SpecConfig(mode, "mtp", args.depth, 4, 64, draft_vocab=draft_vocab)
        engine = Engine(model, spec, max_slots=1, max_len=args.context + args.round_tokens + 80)
        engine.generate([prompt.tolist()], SamplingParams(max_tokens=8, ignore_eos=True), seed=0)
        engine.timings = type(engine.timings)()
        engine.generate([prompt.tolist()],
                        SamplingParams(max_tokens=args.round_tokens, ignore_eos=True), seed=0)
        summary = engine.timings.summary()
        head_bytes = (draft_vocab * config.hidden_size * 2 if draft_vocab
                      else model.lm_head_weight.numel() * 2)
        step_bytes = weight_bytes(model, "mtp.")[0] + head_bytes
        rec = dict(case=f"round-{mode}" + (f"-draft-vocab-{draft_vocab}" if draft_vocab else ""),
                   captured=engine.rounds.graphs.enabled, batch=1, draft_vocab=draft_vocab,
                   nodes=spec.nodes_per_request, total_ms=summary["round_ms"], **summary,
                   eager_fallbacks=engine.rounds.graphs.stats["eager_fallbacks"],
                   weight_floor_without_experts=bool(config.num_experts),
                   weight_floor_ms=floor["weights_ms"] + (args.depth * step_bytes / bw * 1e3
                                                          if mode == "bole" else 0.0))
        records.append(rec)
        print(json.dumps(rec), flush=True)
        del engine
    import triton
    meta = dict(preset=args.preset, device=torch.cuda.get_device_name(dev), torch=torch.__version__,
                triton=triton.__version__,
                dtype="bfloat16" if config.fp8_block is None else
                f"fp8 e4m3 weights ({config.fp8_block[0]}x{config.fp8_block[1]} block scales), "
                "bf16 activations",
                date=_dt.date.today().isoformat(),
                context=args.context, prefill_s=prefill_s,
                prefill_kernel="fla" if model.chunked_prefill else "bole tree path",
                copy_bandwidth_tb_s=bw / 1e12, weight_gb=wbytes / 1e9,
                matmul_tflops_assumed=MATMUL_TFLOPS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"model-forward-{meta['date']}-{args.preset}{args.tag}"
    (out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, records=records), indent=1))
    plot(out / f"{stem}.json")
    print(f"{'case':<16} {'captured':>8} {'total ms':>9} {'kernel ms':>9} {'kernels':>7} {'floor ms':>8}")
    for r in records:
        print(f"{r['case']:<16} {str(r['captured']):>8} {r['total_ms']:>9.2f} "
              f"{r.get('kernel_ms', float('nan')):>9.2f} {r.get('kernels', 0):>7} "
              f"{r.get('floor_ms', r.get('weight_floor_ms', 0)):>8.2f}")
    return 0


def plot(path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    data = json.loads(path.read_text())
    recs = [r for r in data["records"] if not r["case"].startswith("round")]
    cases = list(dict.fromkeys(r["case"] for r in recs))
    rounds = [r for r in data["records"] if r["case"].startswith("round")]
    fig, (ax, rax) = plt.subplots(1, 2, figsize=(13, 3.8), gridspec_kw=dict(width_ratios=[3, 2]))
    bottom = [0.0] * len(rounds)
    for key in ("draft_ms", "verify_ms", "accept_commit_ms", "host_ms"):
        vals = [r[key] for r in rounds]
        rax.bar(range(len(rounds)), vals, 0.4, bottom=bottom, label=key.removesuffix("_ms"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    bars = rax.bar([i + 0.4 for i in range(len(rounds))], [r["weight_floor_ms"] for r in rounds],
                   0.4, color="grey", label="weight floor")
    rax.bar_label(bars, fmt="%.1f", fontsize=7)
    for i, r in enumerate(rounds):
        rax.annotate(f"{r['round_ms']:.1f}", (i, r["round_ms"]), ha="center", va="bottom",
                     fontsize=7)
    rax.set_xticks([i + 0.2 for i in range(len(rounds))],
                   [r["case"].removeprefix("round-").replace("-draft-vocab-", "\ndraft vocab ")
                    for r in rounds], fontsize=7)
    rax.set_ylabel("ms per round (batch 1, captured)")
    rax.legend(fontsize=7)
    for j, (label, pick) in enumerate((("eager", False), ("captured", True))):
        ys = [next(r["total_ms"] for r in recs if r["case"] == c and r["captured"] == pick)
              for c in cases]
        bars = ax.bar([i + 0.28 * j for i in range(len(cases))], ys, 0.28, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    floors = [next(r["floor_ms"] for r in recs if r["case"] == c) for c in cases]
    bars = ax.bar([i + 0.56 for i in range(len(cases))], floors, 0.28, label="floor", color="grey")
    ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks([i + 0.28 for i in range(len(cases))], cases)
    ax.set_ylabel("ms per forward")
    m = data["meta"]
    ax.set_title(f"{m['preset']} (random weights, bf16), context {m['context']}: {m['device']}, "
                 f"torch {m['torch']}, triton {m['triton']}, {m['date']}", fontsize=8)
    ax.legend(fontsize=8)
    return save_png(fig, path)


if __name__ == "__main__":
    sys.exit(main())
