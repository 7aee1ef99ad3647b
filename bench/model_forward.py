"""Whole-model forward latency with random weights: prefill, decode and tree verification (issue 4).

For a preset (default Qwen3.5-9B, bf16, random weights built on the device), one request:
a prefill of --prefill tokens, then for each GDN backend (bole = Triton closed form + cross-layer
commit; tree-serial = node-by-node snapshot kernel + copy commit) one decode step and tree
verification of --nodes trees at depth --depth. Each forward is timed twice: end to end (no
synchronisation inside), and split into full attention / GDN / MLP / rest with a synchronising
section timer (which adds a little per section; the split's sum is reported next to the total).

    python bench/model_forward.py                         # on a GPU -> bench/results/model-forward-<date>.json/.png
    python bench/model_forward.py --preset tiny --device cpu --backends torch --prefill 16 --nodes 8
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bole.models.presets import preset_config  # noqa: E402
from bole.models.qwen3_hybrid import HybridModel, SectionTimer  # noqa: E402
from bole.tree import DraftTree, PackedForest  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from kernels import bench_tree  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after one warm-up."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def split(model: HybridModel, fn, device, reps: int) -> dict[str, float]:
    """Median seconds per section (attention, gdn, mlp, rest) of ``fn``."""
    model.timer = SectionTimer(device)
    runs = []
    fn()
    for _ in range(reps):
        model.timer.reset()
        fn()
        runs.append(dict(model.timer.totals))
    model.timer = None
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in runs[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3.5-9b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--nodes", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--backends", nargs="+", default=["triton", "triton-serial"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None, help="only redraw the plot of this results JSON")
    args = ap.parse_args(argv)
    if args.plot:
        print(plot(Path(args.plot)))
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: pass --device cpu (and --backends torch) for a smoke run", file=sys.stderr)
        return 2
    config = preset_config(args.preset)
    t0 = time.perf_counter()
    model = HybridModel.random(config, dtype=DTYPES[args.dtype], device=device,
                               gdn_backend=args.backends[0])
    build_s = time.perf_counter() - t0
    cache = model.new_cache(max_slots=2, max_len=args.prefill + args.depth + 8)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (args.prefill,), generator=gen)
    prefill_kernel = "fla chunk_gated_delta_rule" if model.prefill_gdn is not None else "bole tree path"
    prefill_check = None
    if model.prefill_gdn is not None:
        try:
            prefill_check = check_prefill(model, cache, prompt[:256])
        except Exception as exc:  # reported, and the timings still run
            prefill_check = dict(error=repr(exc))
        print("prefill check:", json.dumps(prefill_check), flush=True)
    slot = cache.allocate(args.prefill + args.depth + 8)
    model.prefill(cache, slot, prompt[:256], chunk=128)          # warm-up (kernel compilation)
    cache.free(slot)
    slot = cache.allocate(args.prefill + args.depth + 8)
    sync(device)
    t0 = time.perf_counter()
    model.prefill(cache, slot, prompt, chunk=128)
    sync(device)
    prefill_s = time.perf_counter() - t0
    out_dir = Path(args.out or os.environ.get("OUT") or ROOT / "bench" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = out_dir / f"model-forward-partial-{args.preset}.json"
    print(f"built in {build_s:.1f} s, prefill of {args.prefill} tokens in {prefill_s:.2f} s", flush=True)
    rng = np.random.default_rng(0)
    trees = {t: bench_tree(t, args.depth, rng) for t in args.nodes}
    records = []
    for backend in args.backends:
        model.gdn_backend = backend
        cases = [("decode", PackedForest.pack([DraftTree.chain(1)]))] + [
            (f"verify-{t}", PackedForest.pack([trees[t]])) for t in args.nodes]
        for name, forest in cases:
            tokens = torch.randint(0, config.vocab_size, (forest.num_nodes,), generator=gen)
            fwd = lambda f=forest, tk=tokens: model.forward_tree(cache, [slot], f, tk)  # noqa: E731
            total = timed(fwd, device, args.reps)
            parts = split(model, fwd, device, args.reps)
            out = fwd()
            deepest = int(forest.tree(0).depth.argmax())

            def commit(o=out, a=deepest):
                # the state moves on (timing only); the context length is put back
                saved = cache.lengths.clone()
                model.commit(cache, o, [a])
                cache.lengths.copy_(saved)
            commit_s = timed(commit, device, args.reps)
            rec = dict(backend=backend, case=name, nodes=forest.num_nodes,
                       depth=forest.max_depth, total_ms=total * 1e3, commit_ms=commit_s * 1e3,
                       **{f"{k}_ms": v * 1e3 for k, v in parts.items()},
                       split_sum_ms=sum(parts.values()) * 1e3)
            rec["gdn_share"] = parts.get("gdn", 0.0) / max(sum(parts.values()), 1e-12)
            records.append(rec)
            print(json.dumps(rec), flush=True)
            partial.write_text(json.dumps(dict(records=records), indent=1))
    meta = dict(preset=args.preset, device=(torch.cuda.get_device_name(device)
                                            if device.type == "cuda" else "cpu"),
                torch=torch.__version__, dtype=args.dtype, date=_dt.date.today().isoformat(),
                prefill_tokens=args.prefill, prefill_s=prefill_s, build_s=build_s,
                prefill_kernel=prefill_kernel, prefill_check=prefill_check,
                context=int(cache.lengths[slot]), batch=1)
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    path = out_dir / f"model-forward-{meta['date']}-{args.preset}.json"
    path.write_text(json.dumps(dict(meta=meta, records=records), indent=1))
    partial.unlink(missing_ok=True)
    print(json.dumps(meta))
    print(f"{'backend':<14} {'case':<11} {'total ms':>9} {'attn':>7} {'gdn':>7} {'mlp':>7} "
          f"{'rest':>7} {'gdn %':>6} {'commit':>7}")
    for r in records:
        print(f"{r['backend']:<14} {r['case']:<11} {r['total_ms']:>9.2f} "
              f"{r.get('attention_ms', 0):>7.2f} {r.get('gdn_ms', 0):>7.2f} {r.get('mlp_ms', 0):>7.2f} "
              f"{r.get('rest_ms', 0):>7.2f} {100 * r['gdn_share']:>5.1f}% {r['commit_ms']:>7.2f}")
    try:
        print(plot(path))
    except Exception as exc:  # the numbers are saved either way
        print(f"plot failed: {exc!r}")
    return 0


def check_prefill(model: HybridModel, cache, prompt: torch.Tensor) -> dict:
    """Prefill logits and committed GDN states with fla's chunk kernel against Bole's own tree path
    (fla switched off) on the same prompt, next to a control: the tree path against itself with
    another chunking (equal in exact arithmetic), i.e. how far rounding alone moves this model."""
    results = {}
    fla = model.prefill_gdn
    for name, kernel, chunk in (("fla", fla, 128), ("bole", None, 128), ("bole64", None, 64)):
        model.prefill_gdn = kernel
        slot = cache.allocate(prompt.numel() + 1)
        logits = model.prefill(cache, slot, prompt, chunk=chunk).float()
        results[name] = (logits, cache.gdn_state[:, slot].float().clone())
        cache.free(slot)
    model.prefill_gdn = fla
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    agree = lambda a, b: float((a.argmax(-1) == b.argmax(-1)).float().mean())  # noqa: E731
    fl, bo, b64 = results["fla"], results["bole"], results["bole64"]
    return dict(tokens=prompt.numel(), logits_rel_diff=rel(fl[0], bo[0]),
                gdn_state_rel_diff=rel(fl[1], bo[1]), argmax_agreement=agree(fl[0], bo[0]),
                control_chunk64_vs_128=dict(logits_rel_diff=rel(b64[0], bo[0]),
                                            gdn_state_rel_diff=rel(b64[1], bo[1]),
                                            argmax_agreement=agree(b64[0], bo[0])))


def plot(path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    recs, meta = data["records"], data["meta"]
    backends = list(dict.fromkeys(r["backend"] for r in recs))
    fig, axes = plt.subplots(1, len(backends) + 1, figsize=(5 * (len(backends) + 1), 4), squeeze=False)
    parts = ("attention", "gdn", "mlp", "rest")
    for ax, backend in zip(axes[0], backends):
        rs = [r for r in recs if r["backend"] == backend]
        x = np.arange(len(rs))
        bottom = np.zeros(len(rs))
        for part in parts:
            vals = np.array([r.get(f"{part}_ms", 0.0) for r in rs])
            ax.bar(x, vals, bottom=bottom, label=part)
            bottom += vals
        ax.set_xticks(x, [r["case"] for r in rs], rotation=45, fontsize=7)
        ax.set_ylabel("ms per forward (sections, synchronised)")
        ax.set_title(f"{backend}")
        ax.legend(fontsize=7)
    ax = axes[0][-1]
    for backend in backends:
        rs = [r for r in recs if r["backend"] == backend and r["case"].startswith("verify")]
        ax.plot([r["nodes"] for r in rs], [100 * r["gdn_share"] for r in rs], "o-", label=backend)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree nodes")
    ax.set_ylabel("GDN share of the forward (%)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.suptitle(f"{meta['preset']} random weights, {meta['dtype']}, context {meta['context']}, "
                 f"{meta['device']}, {meta['date']}", fontsize=9)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    sys.exit(main())
