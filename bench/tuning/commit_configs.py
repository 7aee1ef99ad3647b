"""The cross-layer factored commit against copy commits, by launch configuration (H200).

For Qwen3.5-9B GDN shapes (24 GDN layers), T = 64 trees of depth 8 and every batch size, it
commits each request's deepest node (a path of 9 nodes) in every layer:

* ``bole``: :func:`commit_factored_triton`, one launch, for a grid of (block_k, block_v, warps,
  stages);
* ``copy-per-layer``: tree-serial's commit, one :func:`commit_from_snapshots_triton` launch per
  layer, each reading that layer's own accepted snapshots (distinct memory, as an engine holds them);
* ``copy-one-launch``: the same copies in one launch over all layers (the strongest copy baseline);
* ``floor``: state bytes read once and written once over the measured copy bandwidth.

Each bole configuration is checked against the fp64 torch commit (:func:`commit_factored`) on the
first layer before it is timed. Writes ``commit-configs-<date><tag>.json`` and a plot of each
batch's best bole configuration, the copy baselines and the floor.

    python bench/tuning/commit_configs.py [--batches 1 4 16 64] [--out DIR] [--tag=-x]
    python bench/tuning/commit_configs.py --plot bench/results/commit-configs-DATE.json   # redraw
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# Run by path, Python puts bench/tuning/ first on sys.path: drop it, so that bench's modules are
# reached as bench.<name> and never shadow, or are shadowed by, an installed package of that name.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench" / "tuning")]

from bench import harness as kb  # noqa: E402  (bench/harness.py: trees, inputs, timing)

from bole.config import gdn_shape  # noqa: E402

NODES = 64


def plot(path: Path) -> Path:
    """Per batch: the best bole configuration, the copy baselines and the byte floor (us, log)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    recs = [r for r in data["records"] if r.get("median_us")]
    batches = sorted({r["batch"] for r in recs})
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    series = {"bole (best config)": [min((r["median_us"] for r in recs if r["batch"] == b
                                          and r["impl"] == "bole"), default=float("nan"))
                                     for b in batches]}
    for impl in ("copy-per-layer", "copy-one-launch", "torch-copy"):
        series[impl] = [next((r["median_us"] for r in recs if r["batch"] == b and r["impl"] == impl),
                             float("nan")) for b in batches]
    series["byte floor"] = [next(r["floor_us"] for r in recs if r["batch"] == b) for b in batches]
    for name, ys in series.items():
        ax.plot(batches, ys, "k--" if name == "byte floor" else "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (T = 64 trees, each committing a 9-node path)")
    ax.set_ylabel("us per commit of all GDN layers")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"{data['meta']['model']} commit, {kb.run_label(data['meta'])}", fontsize=8)
    return kb.save_png(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="qwen3.5-9b")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--blocks", nargs="+", default=["16x64", "32x32", "32x64", "64x64", "16x128",
                                                     "32x128", "64x128"],
                    help="block_k x block_v")
    ap.add_argument("--warps", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--stages", nargs="+", type=int, default=[2, 3])
    kb.add_output_args(ap)
    args = ap.parse_args(argv)
    if args.plot:
        print(plot(Path(args.plot)))
        return 0
    if not torch.cuda.is_available():
        print("commit_configs needs a CUDA device")
        return 0

    from bole.ops.gdn.closed_form import TreeFactors, commit_factored
    from bole.ops.gdn.triton_commit import commit_factored_triton
    from bole.ops.gdn.triton_serial import commit_from_snapshots_triton

    dev = torch.device("cuda")
    shape = gdn_shape(args.model)
    layers = shape.num_gdn_layers
    bw = kb.copy_bandwidth(dev)
    records = []
    for batch in args.batches:
        forest, meta = kb.bench_forest(NODES, batch, batch * 1000 + NODES, dev)
        x = kb.make_inputs(shape, forest, dev, seed=batch)
        _, fac = kb.verify_inputs(x, meta)
        c = kb.commit_inputs(fac, x["initial_state"], forest, layers, dev)
        stacked, pool0, index, lengths, slots = c.factors, c.pool, c.index, c.lengths, c.slots
        pool = pool0.clone()
        R = forest.num_requests
        ref = commit_factored(TreeFactors(*(t.double() for t in (
            fac.log_decay, fac.k, fac.u, fac.k_inv_norm))), x["initial_state"].double(), forest,
            c.accepted)
        state_bytes = pool.numel() * 4
        floor_us = 2 * state_bytes / bw * 1e6

        def record(impl, us, **extra):
            rec = dict(model=shape.name, batch=batch, nodes=NODES, layers=layers, impl=impl,
                       median_us=us, floor_us=floor_us, ratio_to_floor=us / floor_us, **extra)
            records.append(rec)
            print(json.dumps(rec), flush=True)

        for blocks, warps, stages in itertools.product(args.blocks, args.warps, args.stages):
            bk, bv = (int(s) for s in blocks.split("x"))
            cfg = dict(block_k=bk, block_v=bv, num_warps=warps, num_stages=stages)
            try:
                pool.copy_(pool0)
                commit_factored_triton(stacked, pool, slots, index, lengths, **cfg)
                err = float((pool[0].double() - ref).norm() / ref.norm())
                us = kb.time_calls([lambda: commit_factored_triton(stacked, pool, slots, index,
                                                                   lengths, **cfg)])
                record("bole", us, config=cfg, rel_err=err)
            except Exception as exc:          # keep going: one failing config must not end it
                records.append(dict(batch=batch, impl="bole", config=cfg, error=repr(exc)))
        # tree-serial's copy commit reads per-layer snapshots: distinct memory for every layer
        snaps = pool0.clone()                                 # [Ly, R, H_v, d_k, d_v]
        acc = torch.arange(R, device=dev)
        us = kb.time_calls([lambda: [commit_from_snapshots_triton(snaps[i], pool[i], slots, acc)
                                     for i in range(layers)]])
        record("copy-per-layer", us)
        us = kb.time_calls([lambda: commit_from_snapshots_triton(snaps, pool, slots, acc)])
        record("copy-one-launch", us)
        us = kb.time_calls([lambda: pool.copy_(snaps)])
        record("torch-copy", us)
        snaps = pool = pool0 = stacked = c = None  # free the device memory for the next batch
        torch.cuda.empty_cache()

    meta = kb.run_meta(model=args.model, copy_bandwidth_TBps=bw / 1e12, nodes=NODES,
                       depth=kb.DEPTH, timing="CUDA graph replay, median")
    path = kb.results_path(args.out, f"commit-configs-{meta['date']}{args.tag}.json")
    path.write_text(json.dumps(dict(meta=meta, records=records), indent=1))
    for batch in args.batches:
        rs = [r for r in records if r["batch"] == batch and r.get("median_us")]
        best = min((r for r in rs if r["impl"] == "bole"), key=lambda r: r["median_us"], default=None)
        base = {r["impl"]: r["median_us"] for r in rs if r["impl"] != "bole"}
        if best:
            print(f"batch {batch}: bole best {best['median_us']:.1f} us {best['config']} "
                  f"(err {best['rel_err']:.1e}), floor {best['floor_us']:.1f}; "
                  + ", ".join(f"{k} {v:.1f}" for k, v in base.items()))
    print(path, plot(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
