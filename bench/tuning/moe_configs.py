"""The fused MoE's grouped GEMMs by launch configuration, against the byte floor of the experts
they touch (H200).

One MoE layer of a preset (bf16 random weights, random router logits: every token routed
independently), for each token count T (decode, verify widths, prefill chunks): the gate/up GEMM
(SiLU-and-mul fused) and the down GEMM timed apart for every configuration of a grid, each checked
against the torch reference loop first. The floor is the touched experts' weights read once over
the measured copy bandwidth. Prints, per T, the best configuration of each GEMM and the whole
layer (routing and alignment included) with the current pick and the best pair.

    python bench/tuning/moe_configs.py [--preset qwen3.5-35b-a3b] [--tokens 1 8 32 64 256]

``--gemv``: the few-token path instead (bole.ops.moe.gemv), with the shared expert merged as
the model runs it (E + 1 experts, k + 1 slots): each kernel's best tiles per T, and the whole
layer (routing included) through the matrix-vector kernels with their defaults and through the
grouped GEMMs' pick, side by side, which sets ``GEMV_MAX_PAIRS``:

    python bench/tuning/moe_configs.py --gemv --tokens 1 2 3 4 6 8
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

from bench.model_forward import copy_bandwidth  # noqa: E402
from bole.engine.calibrate import captured_ms  # noqa: E402
from bole.models.presets import preset_config  # noqa: E402
from bole.ops.moe import align_blocks, fused_moe, moe_reference, pick_moe_config, route  # noqa: E402
from bole.ops.moe import GEMV_MAX_PAIRS, gemv  # noqa: E402
from bole.ops.moe.grouped_gemm import MoEConfig, _launch  # noqa: E402


def graph_ms(fn) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph."""
    return captured_ms(fn, torch.device("cuda"), reps=30)


def grid(block_ms):
    for bm, bn, bk, w, s in itertools.product(block_ms, (16, 32, 64, 128), (64, 128, 256),
                                              (4, 8), (3,)):
        yield MoEConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s)


def gemv_grid():
    for bn, bk, w in itertools.product((8, 16, 32), (128, 256, 512), (2, 4, 8)):
        yield bn, bk, w


def tune_gemv(c, tokens, dev, bw) -> list[dict]:
    """Best tiles of each matrix-vector kernel per T, and the layer through each path."""
    E, k, H, F = c.num_experts + 1, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(E, 2 * F, H, device=dev, dtype=torch.bfloat16, generator=gen) * H ** -0.5
    w2 = torch.randn(E, H, F, device=dev, dtype=torch.bfloat16, generator=gen) * F ** -0.5
    records = []
    for T in tokens:
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=gen)
        logits = torch.randn(T, E, device=dev, generator=gen)
        weights, ids = route(logits, k, True, shared=True)
        touched = int((torch.bincount(ids.reshape(-1).long(), minlength=E) > 0).sum())
        floor_ms = touched * 3 * H * F * 2 / bw * 1e3
        want = moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
        flat_ids, flat_w = ids.reshape(-1).contiguous(), weights.reshape(-1).contiguous()
        h = torch.empty(T * (k + 1), F, dtype=x.dtype, device=dev)
        y = torch.empty(T, H, dtype=x.dtype, device=dev)
        best = {}
        for bn, bk, w in gemv_grid():
            cfg = gemv.GemvConfig(block_n=bn, block_k=bk, num_warps=w, down_block_n=bn,
                                  down_block_k=bk, down_num_warps=w)
            got = gemv.moe_gemv(x, w13, w2, weights, ids, cfg).float()
            err = ((got - want).norm() / want.norm()).item()
            if err > 2e-2:
                print(f"T={T} {cfg}: relative error {err:.2e}, skipped", file=sys.stderr)
                continue
            up = graph_ms(lambda: gemv.launch_gate_up(x, w13, flat_ids, h, k + 1, bn, bk, w, 3))
            down = graph_ms(lambda: gemv.launch_down_sum(h, w2, flat_ids, flat_w, y, k + 1, bn,
                                                         bk, w, 3))
            for name, ms in (("gate_up", up), ("down", down)):
                if name not in best or ms < best[name][0]:
                    best[name] = (ms, dict(block_n=bn, block_k=bk, num_warps=w))
        tuned = gemv.GemvConfig(**best["gate_up"][1], **{
            "down_" + key: v for key, v in best["down"][1].items()})
        layer = {}
        grouped = pick_moe_config(max(T * (k + 1), GEMV_MAX_PAIRS + 1), E, dev)
        for name, cfg in (("gemv_default", gemv.GemvConfig()), ("gemv_tuned", tuned),
                          ("grouped_pick", grouped)):
            layer[name] = graph_ms(lambda: fused_moe(
                x, w13, w2, *route(logits, k, True, impl="triton", shared=True),
                impl="triton", config=cfg))
        rec = dict(tokens=T, pairs=T * (k + 1), touched_experts=touched, floor_ms=floor_ms,
                   best_gate_up_ms=best["gate_up"][0], best_gate_up=best["gate_up"][1],
                   best_down_ms=best["down"][0], best_down=best["down"][1],
                   **{f"layer_ms_{n}": v for n, v in layer.items()})
        records.append(rec)
        print(json.dumps(rec), flush=True)
    print(f"{'T':>3} {'experts':>7} {'floor':>7} {'up+down':>8} {'gemv dflt':>9} "
          f"{'gemv tuned':>10} {'grouped':>8}  (ms)")
    for r in records:
        print(f"{r['tokens']:>3} {r['touched_experts']:>7} {r['floor_ms']:>7.4f} "
              f"{r['best_gate_up_ms'] + r['best_down_ms']:>8.4f} {r['layer_ms_gemv_default']:>9.4f} "
              f"{r['layer_ms_gemv_tuned']:>10.4f} {r['layer_ms_grouped_pick']:>8.4f}")
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3.5-35b-a3b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 256])
    ap.add_argument("--out", default="")
    ap.add_argument("--gemv", action="store_true", help="tune the few-token kernels instead")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_configs.py times compiled kernels: it needs a GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    c = preset_config(args.preset)
    E, k, H, F = c.num_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(E, 2 * F, H, device=dev, dtype=torch.bfloat16, generator=gen) * H ** -0.5
    w2 = torch.randn(E, H, F, device=dev, dtype=torch.bfloat16, generator=gen) * F ** -0.5
    bw = copy_bandwidth(dev)
    if args.gemv:
        records = tune_gemv(c, args.tokens, dev, bw)
        if args.out:
            Path(args.out).write_text(json.dumps(dict(preset=args.preset, records=records),
                                                 indent=1))
        return 0
    records = []
    for T in args.tokens:
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=gen)
        logits = torch.randn(T, E, device=dev, generator=gen)
        weights, ids = route(logits, k, True)
        touched = int((torch.bincount(ids.reshape(-1).long(), minlength=E) > 0).sum())
        floor_ms = touched * 3 * H * F * 2 / bw * 1e3
        want = moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
        pick = pick_moe_config(T * k, E, dev)
        best = {}
        for cfg in grid((16, 64) if T * k >= 2 * E else (16,)):
            try:
                got = fused_moe(x, w13, w2, weights, ids, impl="triton", config=cfg).float()
            except Exception as e:                       # a tile that does not compile here
                print(f"T={T} {cfg}: {type(e).__name__}", file=sys.stderr)
                continue
            err = ((got - want).norm() / want.norm()).item()
            if err > 2e-2:
                print(f"T={T} {cfg}: relative error {err:.2e}, skipped", file=sys.stderr)
                continue
            align = align_blocks(ids, E, cfg.block_m)
            h = torch.empty(T * k, F, dtype=x.dtype, device=dev)
            o = torch.empty(T * k, H, dtype=torch.float32, device=dev)
            flat_w = weights.reshape(-1).contiguous()
            up = graph_ms(lambda: _launch(x, w13, h, flat_w, align, F, H, gather=True, silu_mul=True,
                                          weighted=False, top_k=k, cfg=cfg))
            down = graph_ms(lambda: _launch(h, w2, o, flat_w, align, H, F, gather=False,
                                            silu_mul=False, weighted=True, top_k=k, cfg=cfg))
            for name, ms in (("gate_up", up), ("down", down)):
                if name not in best or ms < best[name][0]:
                    best[name] = (ms, cfg)
        layer_pick = graph_ms(lambda: fused_moe(x, w13, w2, *route(logits, k, True), impl="triton",
                                                config=pick))
        rec = dict(tokens=T, touched_experts=touched, floor_ms=floor_ms, pick=str(pick),
                   layer_ms_pick=layer_pick,
                   best_gate_up_ms=best["gate_up"][0], best_gate_up=best["gate_up"][1].__dict__,
                   best_down_ms=best["down"][0], best_down=best["down"][1].__dict__)
        records.append(rec)
        print(json.dumps(rec), flush=True)
    print(f"{'T':>5} {'experts':>7} {'floor ms':>8} {'layer (pick)':>12} {'best up+down':>12}")
    for r in records:
        print(f"{r['tokens']:>5} {r['touched_experts']:>7} {r['floor_ms']:>8.4f} "
              f"{r['layer_ms_pick']:>12.4f} {r['best_gate_up_ms'] + r['best_down_ms']:>12.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(preset=args.preset, records=records), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
