"""Where the verification kernel's time goes, by variants that leave a stage out (H200 METHOD.md).

For Qwen3.5-9B GDN shapes at T = 64, depth 8, it times every configuration in a grid
(BV x BK x warps x stages) twice: as is, and with ``max_depth = 0`` (no Neumann sweep: wrong
results, time of everything else), so the difference is the solve's cost. It also times an empty
Triton kernel captured the same way (the launch floor) and records registers / spills of each
compiled variant. Output: ``kernel-probe-<date>.json`` with one record per (batch, config).

    python bench/tuning/kernel_probe.py --batches 1 4 16 [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
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

from bench import harness as kb  # noqa: E402  (bench/harness.py: inputs, timing, byte floor)

from bole.config import gdn_shape  # noqa: E402


def compiled_stats(kernel) -> dict:
    """registers / spills / shared memory of the variants of ``kernel`` compiled so far, by
    constexpr key."""
    out = {}
    try:
        for cache in kernel.device_caches.values():
            for key, ck in cache[0].items():
                out[hash(key)] = dict(n_regs=ck.n_regs, n_spills=ck.n_spills,
                                      shared=ck.metadata.shared, num_warps=ck.metadata.num_warps)
    except Exception as exc:  # the cache layout is a Triton internal
        out["error"] = repr(exc)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="qwen3.5-9b")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--bv", nargs="+", type=int, default=[32, 64, 128])
    ap.add_argument("--bk", nargs="+", type=int, default=[32, 64])
    ap.add_argument("--warps", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--stages", nargs="+", type=int, default=[2])
    # 0/1 (maxnreg: 0 = no cap) values of the VerifyConfig switches; each given one multiplies the
    # grid, an absent one leaves each config's own value (the picked config's with --picked-only)
    kb.add_switch_args(ap)
    ap.add_argument("--maxnreg", nargs="+", type=int, default=None,
                    help="VerifyConfig.maxnreg values (0: no cap)")
    ap.add_argument("--skip-no-sweep", action="store_true",
                    help="do not time the max_depth = 0 variant (halves the run)")
    ap.add_argument("--sets", type=int, default=0,
                    help="input sets rotated per timing; 0: as bench/harness.py (>= 256 MiB, so "
                         "the inputs come from HBM), 8: what this script used before 2026-11-30")
    ap.add_argument("--picked-only", action="store_true",
                    help="time pick_config's choice at each of --stages only (no BV/BK/warps grid)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--compile-workers", type=int, default=0,
                    help="compile the grid in this many processes first (Triton's disk cache)")
    ap.add_argument("--once", action="store_true",
                    help="launch pick_config's choice once per batch, no timing (for ncu)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_probe needs a CUDA device (it times compiled kernels); "
              "bench/tuning/kernel_registers.py reports registers without one")
        return 0

    import triton
    import triton.language as tl

    from bole.ops.gdn.verify import kernel as tv

    @triton.jit
    def _empty(x_ptr):
        if tl.program_id(0) < 0:
            tl.store(x_ptr, 0.0)

    kernel = tv._tree_gdn_verify_kernel
    dev = torch.device("cuda")
    bw = kb.copy_bandwidth(dev)
    meta = kb.run_meta(model=args.model, nodes=args.nodes, depth=kb.DEPTH,
                       copy_bandwidth_TBps=bw / 1e12)
    dummy = torch.zeros(1, device=dev)
    meta["empty_kernel_us"] = kb.time_calls([lambda: _empty[(128,)](dummy)] * 8)
    print(json.dumps(meta), flush=True)
    path = kb.results_path(args.out, f"kernel-probe-{meta['date']}.json")
    shape = gdn_shape(args.model)
    Hv, dk, dv = shape.num_v_heads, shape.head_k_dim, shape.head_v_dim
    records = []
    compiled_configs: set = set()
    for batch in args.batches:
        forest, meta_f = kb.bench_forest(args.nodes, batch, batch * 1000 + args.nodes, dev)
        no_sweep = dataclasses.replace(meta_f, max_depth=0)
        N, R = forest.num_nodes, forest.num_requests
        sets = kb.rotating_sets(shape, forest, dev, seed=batch, n_sets=args.sets)
        floor_us = kb.floor_bytes(shape, N, R) / bw * 1e6
        picked = tv.pick_config(meta_f.block_nodes, dk, dv, R * Hv)
        if args.once:
            x = sets[0]
            kb.verify_inputs(x, meta_f)
            torch.cuda.synchronize()
            print(f"batch {batch}: {picked}", flush=True)
            continue
        ref, _ = kb.reference_fp64(sets[0], forest)
        grid = [tv.VerifyConfig(BV=bv, BK=bk, num_warps=nw, num_stages=st)
                for bv, bk, nw, st in itertools.product(args.bv, args.bk, args.warps, args.stages)]
        if args.picked_only:
            grid = [dataclasses.replace(picked, num_stages=st) for st in args.stages]
        grid = kb.with_switches(grid, args)
        if args.maxnreg is not None:
            grid = [dataclasses.replace(c, maxnreg=cap or None) for c in grid for cap in args.maxnreg]
        if picked not in grid:
            grid.insert(0, picked)
        kb.precompile(args.model, [(args.nodes, c) for c in grid if c not in compiled_configs],
                      args.compile_workers)
        compiled_configs.update(grid)
        for cfg in grid:
            rec = dict(batch=batch, nodes=args.nodes, floor_us=floor_us, picked=cfg == picked,
                       input_sets=len(sets),
                       config=dataclasses.asdict(cfg))
            try:
                def call(x, m, cfg=cfg, out_dtype=None):
                    return kb.verify_inputs(x, m, config=cfg, out_dtype=out_dtype)
                before = set(compiled_stats(kernel))
                o, fac = call(sets[0], meta_f)
                rec["rel_err"] = kb.rel_err(o, ref)
                # the kernel's own accuracy, without bf16's output rounding
                rec["rel_err_fp32_out"] = kb.rel_err(call(sets[0], meta_f, out_dtype=torch.float32)[0], ref)
                rec["us"] = kb.time_calls([lambda x=x: call(x, meta_f) for x in sets])
                if not args.skip_no_sweep:
                    rec["us_no_sweep"] = kb.time_calls([lambda x=x: call(x, no_sweep) for x in sets])
                stats = compiled_stats(kernel)
                rec["compiled"] = [v for k, v in stats.items() if k not in before]
            except Exception as exc:
                rec["error"] = repr(exc)[:500]
            records.append(rec)
            print(json.dumps({k: v for k, v in rec.items() if k != "floor_us"}), flush=True)
            path.write_text(json.dumps(dict(meta=meta, records=records), indent=1))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
