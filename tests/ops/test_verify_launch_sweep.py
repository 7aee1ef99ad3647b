"""Every launch pick_config can pick, compiled, against the fp64 closed form (GPU only).

Head sizes 64 (the bundled model) and 128 (Qwen3.5), trees of 1-128 nodes (chains, stars, random
trees), batches 1-64 reading pool slots: each (block, value tile, whole-head, one-wave, narrow
tile) rule of pick_config is reached. A kernel that reads or writes out of bounds kills the CUDA
context, so a crash here fails this test and every later one in the process.
"""

import numpy as np
import pytest
import torch

from bole.ops.gdn.closed_form import NEUMANN_MAX_DEPTH_FP32, tree_gdn_closed_form
from bole.ops.gdn.verify.kernel import pick_config, tree_gdn_verify_triton
from bole.tree import DraftTree, PackedForest

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="compiled launches need a GPU")

HEADS = {64: (2, 4), 128: (16, 32)}         # d -> (key heads, value heads)
NODES = (1, 2, 8, 15, 16, 17, 31, 32, 33, 40, 63, 64, 65, 96, 127, 128)
BATCHES = (1, 2, 4, 8, 16, 64)


def _tree(kind: str, n: int, rng) -> DraftTree:
    if kind == "chain" or n == 1:
        # the kernel verifies trees of depth <= NEUMANN_MAX_DEPTH_FP32: longer "chains" end in
        # a star whose leaves sit at that depth (their parent is the chain's second-last node)
        deep = min(n, NEUMANN_MAX_DEPTH_FP32 + 1)
        return DraftTree.from_parents(list(range(-1, deep - 1)) + [deep - 2] * (n - deep))
    if kind == "star":
        return DraftTree.star(n)
    return DraftTree.random(n, min(8, n - 1), rng)


@pytest.mark.parametrize("kind", ["chain", "star", "random"])
@pytest.mark.parametrize("nodes", NODES)
@pytest.mark.parametrize("d", sorted(HEADS))
def test_picked_launches(d, nodes, kind):
    H_k, H_v = HEADS[d]
    rng = np.random.default_rng(nodes * 7 + d)
    gen = torch.Generator(device="cuda").manual_seed(nodes + d)
    for batch in BATCHES:
        if d == 128 and batch * nodes > 4096:
            continue
        forest = PackedForest.pack([_tree(kind, nodes, rng) for _ in range(batch)])
        N = forest.num_nodes

        def randn(*shape):
            return torch.randn(*shape, generator=gen, device="cuda")
        q, k, v = (randn(1, N, H_k, d).bfloat16(), randn(1, N, H_k, d).bfloat16(),
                   randn(1, N, H_v, d).bfloat16())
        a, b = randn(1, N, H_v), 2 * randn(1, N, H_v)
        A_log, dt_bias = 0.5 * randn(H_v), 0.5 * randn(H_v)
        pool = 0.5 * randn(batch + 3, H_v, d, d)
        slots = torch.randperm(batch + 3, generator=gen, device="cuda")[:batch].to(torch.int32)
        meta = forest.kernel_meta("cuda")
        config = pick_config(meta.block_nodes, d, d, batch * H_v)
        o, f = tree_gdn_verify_triton(q, k, v, meta, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
                                      initial_state=pool, state_indices=slots,
                                      use_qk_l2norm_in_kernel=True, out_dtype=torch.float32)
        o_ref, f_ref = tree_gdn_closed_form(
            q.double(), k.double(), v.double(), forest, a=a.double(), b=b.double(),
            A_log=A_log.double(), dt_bias=dt_bias.double(),
            initial_state=pool[slots.long()].double(), use_qk_l2norm_in_kernel=True,
            check_values=False)
        torch.cuda.synchronize()
        for name, got, want in (("o", o, o_ref), ("u", f.u, f_ref.u)):
            err = float((got.double() - want).abs().max() / want.abs().max().clamp(min=1))
            assert err < 2e-2, f"{name}: {err:.3g} at batch {batch} with {config}"
