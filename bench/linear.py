"""Linear layers at decode shapes: cuBLAS against bole/ops/linear.py's kernel and the copy rate.

For every distinct projection of a preset (default Qwen3.5-9B; its MTP head's fc and a 32k
draft-vocabulary head too) and every row count of --rows, times ``F.linear`` (cuBLAS) and each
launch of the sweep grid, each captured in a CUDA graph of calls over weight copies rotated so
that no call finds its weight in L2 (as in a forward, where each layer reads its own). Prints
each shape's best launch and its ratio to cuBLAS, then the preset's decode (one row) over all its
layers: cuBLAS's sum, the best launches' sum, and the weight floor (bytes over the measured copy
rate, read + write counted as bole's other benchmarks count it).

    python bench/linear.py             # -> bench/results/linear-<date>-<preset>.{json,png}
    python bench/linear.py --rows 1 --quick                # a smaller grid
    python bench/linear.py --fp8 --rows 1 8 32 64          # FP8 weights (128 x 128 blocks)

``--fp8``: each weight quantized as Qwen's FP8 releases are; cuBLAS multiplies the dequantized
bf16 weight (what dequantize-then-bf16 costs at best), each launch of the FP8 kernel's grid reads
the FP8 bytes; the floor counts the FP8 values and their fp32 scales.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
# Run by path, Python puts bench/ first on sys.path: drop it, so that bench's modules are reached
# as bench.<name> and can never shadow, or be shadowed by, an installed package of the same name.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench")]

from bole.engine.calibrate import captured_ms  # noqa: E402
from bole.models.presets import preset_config  # noqa: E402
from bole.ops.fp8 import fp8_linear, quantize_blockwise  # noqa: E402
from bole.ops.fp8.linear import Fp8Tiles  # noqa: E402
from bole.ops.linear import LinearConfig, linear_triton, pick_linear_config  # noqa: E402
from bench.harness import results_path, run_meta, save_png  # noqa: E402
from bench.model_forward import copy_bandwidth  # noqa: E402

L2_BYTES = 50 * 2 ** 20          # the H200's L2: rotate through at least 4x this


def preset_shapes(name: str, draft_vocab: int) -> list[dict]:
    """The preset's projections ``{name, N, K, count}`` (count: per decode forward; the MTP
    head's shapes with count 0: they run in drafting, not in the decode)."""
    c = preset_config(name)
    h = c.hidden_size
    n_gdn = sum(1 for t in c.layer_types if t == "linear_attention")
    n_attn = c.num_hidden_layers - n_gdn
    hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    conv = 2 * hk * dk + hv * dv
    hd, hq, hkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    return [
        dict(name="gdn.in_proj", N=conv + hv * dv + 2 * hv, K=h, count=n_gdn),
        dict(name="gdn.out_proj", N=h, K=hv * dv, count=n_gdn),
        dict(name="attn.qkv", N=2 * hq * hd + 2 * hkv * hd, K=h, count=n_attn),
        dict(name="attn.o_proj", N=h, K=hq * hd, count=n_attn),
        dict(name="mlp.gate_up", N=2 * c.intermediate_size, K=h, count=c.num_hidden_layers),
        dict(name="mlp.down", N=h, K=c.intermediate_size, count=c.num_hidden_layers),
        dict(name="lm_head", N=c.vocab_size, K=h, count=1),
        dict(name="mtp.fc", N=h, K=2 * h, count=0),
        dict(name=f"mtp.head-{draft_vocab}", N=draft_vocab, K=h, count=0),
    ]


def sweep_grid(quick: bool) -> list[LinearConfig]:
    return [LinearConfig(bn, bk, 4, s)
            for bn, bk, s in itertools.product((16, 32, 64), (128, 256),
                                               (3, 5) if not quick else (4,))]


def time_calls(fn_for, copies: int, reps: int) -> float:
    """Median ms per call over a captured graph of ``copies`` calls (``fn_for(i)`` the i-th)."""
    def calls():
        for i in range(copies):
            fn_for(i)
    return captured_ms(calls, torch.device("cuda"), reps) / copies


def time_grid(run, ref: torch.Tensor, grid, copies: int, reps: int,
              key: str) -> tuple[list[dict], dict | None]:
    """Each launch ``cfg`` of ``grid``: ``run(cfg, i)`` on the i-th weight copy, its error
    relative to ``ref`` (copy 0) and its ms per call; a launch the compiler refuses is kept with
    its error. Returns the records (the launch under ``key``) and the fastest accurate one."""
    records = []
    for cfg in grid:
        try:
            y = run(cfg, 0)
            err = ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
            ms = time_calls(lambda i: run(cfg, i), copies, reps)
        except Exception as e:                       # a launch the compiler refuses
            records.append({key: vars(cfg), "error": str(e)[:200]})
            continue
        records.append({key: vars(cfg), "ms": ms, "rel_err": err})
    ok = [c for c in records if "ms" in c and c["rel_err"] < 2e-2]
    return records, min(ok, key=lambda c: c["ms"], default=None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3.5-9b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--draft-vocab", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="a smaller sweep grid")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tag", default="")
    ap.add_argument("--fp8", action="store_true",
                    help="FP8 weights with 128 x 128 block scales: the FP8 kernel's grid")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/linear.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dev, dtype = torch.device("cuda"), torch.bfloat16
    bw = copy_bandwidth(dev)
    meta = run_meta(preset=args.preset, dtype="bfloat16", copy_bandwidth_tb_s=bw / 1e12)
    path = results_path(args.out, f"linear-{meta['date']}-{args.preset}{args.tag}.json")
    if args.fp8:
        return fp8_sweep(args, dev, bw)
    records = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for shape in preset_shapes(args.preset, args.draft_vocab):
        N, K = shape["N"], shape["K"]
        nbytes = N * K * 2
        copies = max(1, min(16, -(-4 * L2_BYTES // nbytes)))
        weights = [torch.randn(N, K, device=dev, dtype=dtype, generator=gen) * 0.02
                   for _ in range(copies)]
        for M in args.rows:
            x = torch.randn(M, K, device=dev, dtype=dtype, generator=gen)
            ref = F.linear(x.float(), weights[0].float())
            cublas = time_calls(lambda i: F.linear(x, weights[i]), copies, args.reps)
            rec = dict(shape=shape["name"], N=N, K=K, count=shape["count"], rows=M,
                       weight_mb=nbytes / 1e6, cublas_ms=cublas,
                       cublas_tb_s=nbytes / cublas / 1e9, floor_ms=nbytes / bw * 1e3,
                       picked=None, picked_ms=None)
            rec["configs"], best = time_grid(
                lambda cfg, i: linear_triton(x, weights[i], config=cfg), ref,
                sweep_grid(args.quick), copies, args.reps, "config")
            if best:
                rec.update(best=best["config"], best_ms=best["ms"],
                           best_tb_s=nbytes / best["ms"] / 1e9, vs_cublas=cublas / best["ms"])
            picked = pick_linear_config(M, N, K)
            if picked is not None:
                rec["picked"] = vars(picked)
                rec["picked_ms"] = time_calls(
                    lambda i: linear_triton(x, weights[i], config=picked), copies, args.reps)
            records.append(rec)
            print(f"{shape['name']:<18} M={M:<3} {N:>6}x{K:<6} cublas {cublas * 1e3:7.1f} us "
                  f"({rec['cublas_tb_s']:.2f} TB/s)  best "
                  f"{rec.get('best_ms', float('nan')) * 1e3:7.1f} us "
                  f"({rec.get('best_tb_s', 0):.2f} TB/s, {rec.get('vs_cublas', 0):.2f}x) "
                  f"{rec.get('best')}  picked "
                  f"{(rec['picked_ms'] or float('nan')) * 1e3:7.1f} us", flush=True)
        del weights
        torch.cuda.empty_cache()
        path.write_text(json.dumps(dict(meta=meta, records=records), indent=1))
    decode = [r for r in records if r["rows"] == 1 and r["count"]]
    if decode:
        summary = dict(
            cublas_ms=sum(r["cublas_ms"] * r["count"] for r in decode),
            best_ms=sum(min(r["cublas_ms"], r.get("best_ms") or r["cublas_ms"]) * r["count"]
                        for r in decode),
            picked_ms=sum((r["picked_ms"] or r["cublas_ms"]) * r["count"] for r in decode),
            floor_ms=sum(r["floor_ms"] * r["count"] for r in decode))
        summary["cublas_over_floor"] = summary["cublas_ms"] / summary["floor_ms"]
        summary["picked_over_floor"] = summary["picked_ms"] / summary["floor_ms"]
        meta["decode_linear_layers"] = summary
        print(json.dumps(dict(decode_linear_layers=summary)), flush=True)
    path.write_text(json.dumps(dict(meta=meta, records=records), indent=1))
    print(f"wrote {path} and {plot(path)}")
    return 0


def fp8_grid(quick: bool) -> list[Fp8Tiles]:
    return [Fp8Tiles(bn, bk, w, s) for bn, bk, w, s in itertools.product(
        (16, 32, 64), (64, 128), (4,) if quick else (2, 4), (4,) if quick else (3, 5))]


def fp8_sweep(args, dev, bw: float) -> int:
    """``--fp8``: per projection and row count, cuBLAS on the dequantized weight, each launch of
    the FP8 kernel, and the FP8 floor; then the decode's sums."""
    meta = run_meta(preset=args.preset, dtype="fp8 e4m3 weights (128x128 blocks), bf16 "
                    "activations", copy_bandwidth_tb_s=bw / 1e12)
    path = results_path(args.out, f"linear-{meta['date']}-{args.preset}-fp8{args.tag}.json")
    records = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for shape in preset_shapes(args.preset, args.draft_vocab):
        N, K = shape["N"], shape["K"]
        nbytes = N * K + (-(-N // 128)) * (-(-K // 128)) * 4
        copies = max(1, min(16, -(-4 * L2_BYTES // nbytes)))
        weights = [quantize_blockwise(torch.randn(N, K, device=dev, generator=gen) * 0.02)
                   for _ in range(copies)]
        dense = [w.dequantize(torch.bfloat16) for w in weights[:max(1, copies // 2)]]
        for M in args.rows:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=gen)
            ref = F.linear(x.float(), dense[0].float())
            cublas = time_calls(lambda i: F.linear(x, dense[i % len(dense)]), len(dense),
                                args.reps)
            rec = dict(shape=shape["name"], N=N, K=K, count=shape["count"], rows=M,
                       fp8_mb=nbytes / 1e6, cublas_bf16_ms=cublas, floor_ms=nbytes / bw * 1e3)
            rec["configs"], best = time_grid(
                lambda tiles, i: fp8_linear(x, weights[i], kernel=True, tiles=tiles), ref,
                fp8_grid(args.quick), copies, args.reps, "tiles")
            default = next((c for c in rec["configs"] if "ms" in c and c["rel_err"] < 2e-2
                            and c["tiles"] == vars(Fp8Tiles())), None)
            if best:
                rec.update(best=best["tiles"], best_ms=best["ms"],
                           best_over_floor=best["ms"] / rec["floor_ms"],
                           vs_cublas_bf16=cublas / best["ms"])
            if default:
                rec["default_ms"] = default["ms"]
            records.append(rec)
            print(f"{shape['name']:<18} M={M:<3} {N:>6}x{K:<6} bf16 cublas {cublas * 1e3:7.1f} us"
                  f"  fp8 best {rec.get('best_ms', float('nan')) * 1e3:7.1f} us "
                  f"({rec.get('best_over_floor', 0):.2f}x floor) {rec.get('best')}", flush=True)
        del weights, dense
        torch.cuda.empty_cache()
        path.write_text(json.dumps(dict(meta=meta, records=records), indent=1))
    decode = [r for r in records if r["rows"] == 1 and r["count"]]
    if decode:
        meta["decode_linear_layers"] = summary = dict(
            cublas_bf16_ms=sum(r["cublas_bf16_ms"] * r["count"] for r in decode),
            fp8_best_ms=sum(r.get("best_ms", r["cublas_bf16_ms"]) * r["count"] for r in decode),
            fp8_default_ms=sum(r.get("default_ms", r["cublas_bf16_ms"]) * r["count"]
                               for r in decode),
            fp8_floor_ms=sum(r["floor_ms"] * r["count"] for r in decode))
        print(json.dumps(dict(decode_linear_layers=summary)), flush=True)
    path.write_text(json.dumps(dict(meta=meta, records=records), indent=1))
    print(f"wrote {path}")
    return 0


def plot(path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    recs, bw = data["records"], data["meta"]["copy_bandwidth_tb_s"]
    rows = sorted({r["rows"] for r in recs})
    fig, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 4.2), squeeze=False,
                             sharey=True)
    for ax, M in zip(axes[0], rows):
        rs = [r for r in recs if r["rows"] == M]
        xs = range(len(rs))
        ax.bar([x - 0.2 for x in xs], [r["cublas_tb_s"] for r in rs], 0.4, label="cuBLAS")
        ax.bar([x + 0.2 for x in xs], [r.get("best_tb_s", 0) for r in rs], 0.4,
               label="bole (best launch)")
        ax.axhline(bw, color="grey", ls="--", label="copy rate")
        ax.set_xticks(list(xs), [r["shape"] for r in rs], rotation=60, ha="right", fontsize=7)
        ax.set_title(f"{M} row{'s' if M > 1 else ''} of x")
    axes[0][0].set_ylabel("weight bytes read per second (TB/s)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{data['meta']['preset']} linear layers, {data['meta']['device']}")
    return save_png(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
