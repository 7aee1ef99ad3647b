"""Tree attention's context splits at decode shapes: microseconds per call and TB/s of the
committed keys and values read, for each ``num_splits`` against the default rule
(:func:`bole.ops.attention.default_num_splits`).

Shapes: Qwen3.5-9B's full-attention layers (16 query heads, 4 kv heads, head dim 256), bf16,
``--context`` committed positions per request, R requests of Tq tree nodes each (Tq = 1 is a
decode or an MTP step's first node, 2 an MTP step's frontier, 16 and 32 a verify forward's tree).
Each point is the median of ``--reps`` replays of the call captured in a CUDA graph, as a
round replays it, timed under device events (:func:`bole.engine.calibrate.captured_ms`; a wall
clock on the CPU). Writes ``attention-splits-<date>.json`` (and a plot) under --out.

    python bench/attention_splits.py --out /tmp/attn          # on a GPU
    TRITON_INTERPRET=1 python bench/attention_splits.py --device cpu --context 64 \
        --batches 1 2 --nodes 1 4 --splits 1 2 --reps 1 --out /tmp/attn   # smoke run
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
# Run by path, Python puts bench/ first on sys.path: drop it, so that bench's modules are reached
# as bench.<name> and can never shadow, or be shadowed by, an installed package of the same name.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench")]

from bench.harness import save_png  # noqa: E402

from bole.engine.calibrate import captured_ms  # noqa: E402
from bole.ops.attention.kernel import _tile, default_num_splits, tree_attention  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 16, 32])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("no CUDA device: pass --device cpu (with TRITON_INTERPRET=1) for a smoke run",
              file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    Hq, Hkv, D, dt = 16, 4, 256, torch.bfloat16 if cuda else torch.float32
    Tk_max = max(args.nodes)
    M = args.context + 128 + Tk_max + 2                  # a slot as the e2e study sizes it
    S = max(args.batches)
    gen = torch.Generator(device=dev).manual_seed(0)
    k_pool = torch.randn(S, M, Hkv, D, dtype=dt, device=dev, generator=gen)
    v_pool = torch.randn(S, M, Hkv, D, dtype=dt, device=dev, generator=gen)
    records = []
    for R in args.batches:
        slots = torch.arange(R, dtype=torch.int32, device=dev)
        ctx = torch.full((R,), args.context, dtype=torch.int32, device=dev)
        for Tq in args.nodes:
            q = torch.randn(R * Tq, Hq, D, dtype=dt, device=dev, generator=gen)
            mask = torch.ones(Tq, Tq, dtype=torch.bool, device=dev).tril().repeat(R, 1)
            tb = R * args.context * Hkv * D * 2 * k_pool.element_size() / 1e12

            def call(n):
                return lambda: tree_attention(q, k_pool, v_pool, slots, ctx, mask,
                                              scale=D ** -0.5, num_splits=n)
            ref = call(1)()
            rec = dict(batch=R, nodes=Tq, default_splits=None, us={})
            for n in [None, *args.splits]:
                out = call(n)()
                err = (out.float() - ref.float()).abs().max().item()
                if err > (2e-2 if cuda else 1e-4):
                    raise SystemExit(f"splits {n} differ from one split by {err} at R={R}, Tq={Tq}")
                rec["us"][str(n or "default")] = 1e3 * captured_ms(call(n), dev, args.reps)
            nqb = triton.cdiv(Tq, _tile(Tq, Hq // Hkv, D)["BQ"])
            rec["default_splits"] = default_num_splits(R, Hkv, nqb, M - Tq)
            best = min(args.splits, key=lambda n: rec["us"][str(n)])
            rec.update(best_splits=best, best_us=rec["us"][str(best)],
                       default_us=rec["us"]["default"],
                       default_tb_s=tb / (rec["us"]["default"] / 1e6),
                       best_tb_s=tb / (rec["us"][str(best)] / 1e6))
            print(json.dumps(rec), flush=True)
            records.append(rec)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    date = _dt.date.today().isoformat()
    meta = dict(date=date, device=torch.cuda.get_device_name() if cuda else "cpu",
                torch=torch.__version__,
                triton=triton.__version__, context=args.context, slot_len=M,
                heads=[Hq, Hkv, D], dtype=str(dt).removeprefix("torch."))
    path = out / f"attention-splits-{date}.json"
    path.write_text(json.dumps(dict(meta=meta, records=records), indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(args.nodes), figsize=(4 * len(args.nodes), 3.5), sharey=True)
    for ax, Tq in zip(axes, args.nodes):
        for n in args.splits:
            pts = [(r["batch"], r["us"][str(n)]) for r in records if r["nodes"] == Tq]
            ax.plot(*zip(*pts), marker=".", label=f"{n} splits")
        pts = [(r["batch"], r["default_us"]) for r in records if r["nodes"] == Tq]
        ax.plot(*zip(*pts), "k--", label="default")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{Tq} nodes a request", fontsize=8)
        ax.set_xlabel("requests")
    axes[0].set_ylabel("us a call")
    axes[0].legend(fontsize=6)
    fig.suptitle(f"tree attention, {args.context} context, {meta['device']}, {date}", fontsize=8)
    print(path, save_png(fig, path), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
