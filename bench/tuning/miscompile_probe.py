"""The launch Triton 3.6 miscompiles on the H200, and its neighbours (a diagnostic, not a timing).

Runs the verification kernel with every VerifyConfig switch off, 8 warps, on the inputs of
tests/ops' ``test_table_configs_cuda`` (a random 60- or 120-node tree plus a 9-chain, 2 key / 4
value heads, d = 128), for bf16 / fp16 / fp32 inputs, "tf32" / "ieee", 3 / 2 stages and BV 128 / 64,
and prints O's and U's error against the fp64 closed form. On 2026-11-30 (seventh session) only
BT = 64, BV = 128, 3 stages with 16-bit inputs under "tf32" was wrong (O ~1e-1); the wrapper now
refuses that launch, so this script switches the refusal off to show it.

    python bench/tuning/miscompile_probe.py [--nodes 60 120]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
# Run by path, Python puts bench/tuning/ first on sys.path: drop it, so that bench's modules are
# reached as bench.<name> and never shadow, or are shadowed by, an installed package of that name.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench" / "tuning")]
sys.path.insert(0, str(ROOT / "tests" / "ops"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", nargs="+", type=int, default=[60, 120])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("miscompile_probe needs a CUDA device (it checks compiled kernels)")
        return 0
    import test_gdn_triton_verify as t          # the tests' inputs, reference and launcher

    from bole.ops.gdn.verify import kernel as tv
    from bole.tree import DraftTree, PackedForest

    tv._refuse_known_miscompile = lambda *a, **k: None     # show the launch it refuses
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {tv.triton.__version__}")
    for nodes in args.nodes:
        forest = PackedForest.pack([DraftTree.random(nodes, 8, np.random.default_rng(nodes)),
                                    DraftTree.chain(9)])
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            case = t.make_case(forest, H_k=2, H_v=4, d_k=128, d_v=128, raw=True, dtype=dtype,
                               pool_slots=3, seed=nodes)
            o_ref, f_ref = t.run_reference(case, forest)
            for precision in ("tf32", "ieee"):
                for stages in (3, 2):
                    for bv in (128, 64):
                        config = tv.VerifyConfig(BV=bv, BK=32, num_warps=8, num_stages=stages)
                        o, f = t.run_kernel(case, forest, precision=precision, config=config,
                                            out_dtype=torch.float32)
                        print(f"nodes {nodes} {str(dtype)[6:]:>8} {precision} BV {bv:>3} "
                              f"stages {stages}: O {t.rel_err(o, o_ref):.1e} U "
                              f"{t.rel_err(f.u, f_ref.u):.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
