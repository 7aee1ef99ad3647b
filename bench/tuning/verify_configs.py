"""Correctness of every compiled verification-kernel configuration on this GPU (not a timing).

The interpreter cannot catch a miscompile, so this runs each configuration of a grid
(BV x BK x warps) compiled, on Qwen3.5-9B-shaped packed forests of random trees
(bf16 inputs, raw gates, in-kernel l2 norm), several times on the same inputs, and records per
configuration: the error of O and U against the fp64 closed form, whether repeated runs agree bit
for bit, and which (request, head) pairs have U off. A configuration is "ok" when O is within
``O_TOL`` (bf16 output rounding is 2e-3) and U within ``U_TOL`` of fp64 on every run.

    python bench/tuning/verify_configs.py [--batches 1 4 16] [--nodes 64 120] [--out DIR]

Writes ``verify-configs-<date>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
# Run by path, Python puts bench/tuning/ first on sys.path: drop it, so that bench's modules are
# reached as bench.<name> and never shadow, or are shadowed by, an installed package of that name.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench" / "tuning")]

from bench import harness as kb  # noqa: E402  (bench/harness.py: trees, inputs, fp64 reference)

from bole.config import gdn_shape  # noqa: E402

O_TOL = 4e-3        # ||o - o64|| / ||o64||, bf16 output
U_TOL = 1e-3        # max |u - u64| / max |u64| per (request, head), fp32 output of tf32 dots


def per_pair_err(x: torch.Tensor, ref: torch.Tensor, cu: list[int]) -> np.ndarray:
    """[R, H] max-abs error of each request's rows relative to the max of its reference."""
    x, ref = x.double().cpu(), ref.double().cpu()
    out = np.zeros((len(cu) - 1, x.shape[1]))
    for r in range(len(cu) - 1):
        d = (x[cu[r]:cu[r + 1]] - ref[cu[r]:cu[r + 1]]).abs().flatten(2).amax(dim=(0, 2))
        s = ref[cu[r]:cu[r + 1]].abs().flatten(2).amax(dim=(0, 2)).clamp_min(1e-30)
        out[r] = (d / s).numpy()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="qwen3.5-9b")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--nodes", nargs="+", type=int, default=[64, 120])
    ap.add_argument("--bv", nargs="+", type=int, default=[32, 64, 128])
    ap.add_argument("--bk", nargs="+", type=int, default=[32])
    ap.add_argument("--warps", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--maxnreg", nargs="+", type=int, default=[0], help="0: no register cap")
    ap.add_argument("--stages", nargs="+", type=int, default=[2])
    kb.add_switch_args(ap)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("verify_configs needs a CUDA device (it checks compiled kernels)")
        return 0
    from bole.ops.gdn.verify.kernel import VerifyConfig, pick_config

    dev = torch.device("cuda")
    shape = gdn_shape(args.model)
    records = []
    for nodes, batch in itertools.product(args.nodes, args.batches):
        forest, meta = kb.bench_forest(nodes, batch, batch * 1000 + nodes + 1, dev)
        cu = meta.cu_nodes.tolist()
        x = kb.make_inputs(shape, forest, dev, seed=nodes * 13 + batch)
        ref, ref_f = kb.reference_fp64(x, forest)
        ref, ref_u = ref.reshape(forest.num_nodes, shape.num_v_heads, -1), ref_f.u
        picked = pick_config(meta.block_nodes, shape.head_k_dim, shape.head_v_dim,
                             batch * shape.num_v_heads)
        grid = kb.with_switches(
            [VerifyConfig(BV=bv, BK=bk, num_warps=nw, num_stages=st, maxnreg=cap or None)
             for bv, bk, nw, cap, st in itertools.product(args.bv, args.bk, args.warps,
                                                          args.maxnreg, args.stages)], args)
        for cfg in [picked] + [c for c in grid if c != picked]:
            rec = dict(nodes=nodes, batch=batch, block_nodes=meta.block_nodes,
                       config=dataclasses.asdict(cfg), picked=cfg == picked)
            try:
                outs = []
                for _ in range(args.repeats):
                    o, f = kb.verify_inputs(x, meta, config=cfg)
                    outs.append((o.reshape(forest.num_nodes, shape.num_v_heads, -1).clone(),
                                 f.u.clone()))
                torch.cuda.synchronize()
                o_errs = [kb.rel_err(o, ref) for o, _ in outs]
                u_pairs = [per_pair_err(u, ref_u, cu) for _, u in outs]
                u_errs = [float(p.max()) for p in u_pairs]
                deterministic = all(torch.equal(o, outs[0][0]) and torch.equal(u, outs[0][1])
                                    for o, u in outs[1:])
                worst = u_pairs[int(np.argmax(u_errs))]
                bad = np.argwhere(worst > U_TOL)
                rec.update(o_rel_err=o_errs, u_rel_err=u_errs, deterministic=deterministic,
                           bad_pairs=len(bad), first_bad=bad[:8].tolist(),
                           ok=max(o_errs) <= O_TOL and max(u_errs) <= U_TOL)
            except Exception as exc:          # keep going: record the failure
                rec.update(ok=False, error=repr(exc))
            records.append(rec)
            print(json.dumps(rec), flush=True)

    meta = kb.run_meta(model=args.model, o_tol=O_TOL, u_tol=U_TOL, repeats=args.repeats)
    path = kb.results_path(args.out, f"verify-configs-{meta['date']}.json")
    path.write_text(json.dumps(dict(meta=meta, records=records), indent=1))
    bad = [r for r in records if not r["ok"]]
    print(f"{len(records) - len(bad)} of {len(records)} ok; not ok: "
          + "; ".join(f"T={r['nodes']} B={r['batch']} {r['config']}" for r in bad))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
