"""Triton kernels against the torch references (interpreted on CPU by tests/conftest.py)."""

import numpy as np
import pytest
import torch

from bole.ops.gdn.closed_form import TreeFactors, commit_factored, tree_gdn_closed_form
from bole.ops.gdn.triton_commit import commit_factored_triton
from bole.ops.gdn.triton_serial import (
    commit_from_snapshots_triton,
    tree_gdn_serial_triton,
)
from bole.tree import DraftTree, PackedForest
from tests.kernel_utils import DEV, assert_rel
from tests.strategies import padded

#: the kernel against torch's commit_factored on the same fp32 factors (and against the copy
#: commit): measured at most 2.2e-7 relative to the state's magnitude on these inputs
COMMIT_TOL = 5e-7


def layer_inputs(forest, H_k, H_v, d_k, d_v, seed, dtype=torch.float32, g_scale=2.0, g=None):
    gen = torch.Generator().manual_seed(seed)
    N = forest.num_nodes
    x = dict(q=torch.randn(1, N, H_k, d_k, generator=gen).to(dtype),
             k=torch.randn(1, N, H_k, d_k, generator=gen).to(dtype),
             v=torch.randn(1, N, H_v, d_v, generator=gen).to(dtype),
             g=-torch.rand(1, N, H_v, generator=gen) * g_scale if g is None else g,
             beta=torch.rand(1, N, H_v, generator=gen))
    return x


def make_factors(forest, s_pre, H_k, H_v, d_k, d_v, seed, *, k_inv_norm=False,
                 dtype=torch.float32, **kw):
    """Real factors from the torch closed form (l2norm in kernel).

    With ``k_inv_norm`` the factors keep the raw keys (in the input dtype) and the inverse norms,
    as a kernel that normalises in-kernel would.
    """
    x = layer_inputs(forest, H_k, H_v, d_k, d_v, seed, dtype=dtype, **kw)
    _, f = tree_gdn_closed_form(**x, forest=forest, initial_state=s_pre,
                                use_qk_l2norm_in_kernel=True)
    if k_inv_norm:
        raw = x["k"][0]
        inv = torch.rsqrt((raw.float() ** 2).sum(-1) + 1e-6)
        f = TreeFactors(f.log_decay, raw, f.u, k_inv_norm=inv)
    return f


def forest_3():
    rng = np.random.default_rng(0)
    return padded(PackedForest.pack([DraftTree.random(9, 4, rng), DraftTree.chain(6),
                              DraftTree.full_kary(2, 2)]), 24)


def commit_accepted(factors, pool, slots, forest, accepted, **kwargs):
    """:func:`commit_factored_triton` with each request's path to its ``accepted`` local node,
    built on the host (the engine builds them on the device)."""
    index, lengths = forest.padded_paths(accepted)
    return commit_factored_triton(factors, pool, slots, index.to(pool.device),
                                  lengths.to(pool.device), **kwargs)


def factors_to(f, device):
    return TreeFactors(f.log_decay.to(device), f.k.to(device), f.u.to(device),
                       None if f.k_inv_norm is None else f.k_inv_norm.to(device))


def expected_pool(factors, pool, slots, forest, accepted):
    """Oracle: torch commit_factored on the gathered S_pre, scattered back into a copy."""
    layered = pool.dim() == 5
    s_pre = pool[:, slots] if layered else pool[slots]
    new = commit_factored(factors, s_pre, forest, accepted)
    out = pool.clone()
    if layered:
        out[:, slots] = new
    else:
        out[slots] = new
    return out


@pytest.mark.parametrize("k_inv_norm", [False, True])
def test_single_layer_matches_torch(k_inv_norm):
    forest = forest_3()
    H_k, H_v, d_k, d_v = 2, 4, 16, 32
    slots = torch.tensor([5, 0, 2])
    pool = torch.randn(6, H_v, d_k, d_v)
    f = make_factors(forest, pool[slots], H_k, H_v, d_k, d_v, seed=1, k_inv_norm=k_inv_norm)
    accepted = [7, 5, 4]
    exp = expected_pool(f, pool, slots, forest, accepted)
    pool_dev = pool.clone().to(DEV)
    out = commit_accepted(factors_to(f, DEV), pool_dev, slots.to(DEV), forest,
                                          accepted, check_values=True)
    assert out is pool_dev
    assert_rel(pool_dev, exp, COMMIT_TOL)
    untouched = torch.tensor([1, 3, 4])
    assert torch.equal(pool_dev.cpu()[untouched], pool[untouched])


@pytest.mark.parametrize("k_inv_norm", [False, True])
def test_three_layers_one_launch(k_inv_norm):
    forest = forest_3()
    Ly, H_k, H_v, d_k, d_v = 3, 1, 2, 32, 16
    slots = torch.tensor([3, 6, 1])                 # permuted, into a larger pool
    pool = torch.randn(Ly, 7, H_v, d_k, d_v)
    layers = [make_factors(forest, pool[i, slots], H_k, H_v, d_k, d_v, seed=10 + i,
                           k_inv_norm=k_inv_norm) for i in range(Ly)]
    f = TreeFactors.stack(layers)
    accepted = [3, 0, 6]                             # request 1 accepts only its root
    exp = expected_pool(f, pool, slots, forest, accepted)
    index, lengths = forest.padded_paths(accepted)
    pool_dev = pool.clone().to(DEV)
    commit_factored_triton(factors_to(f, DEV), pool_dev, slots.to(DEV), index.to(DEV),
                           lengths.to(DEV), block_k=16, check_values=True)
    assert_rel(pool_dev, exp, COMMIT_TOL)
    keep = torch.tensor([0, 2, 4, 5])
    assert torch.equal(pool_dev.cpu()[:, keep], pool[:, keep])
    # per-layer torch commit agrees layer by layer
    for i in range(Ly):
        single = commit_factored(layers[i], pool[i, slots], forest, accepted)
        assert_rel(pool_dev[i, slots.to(DEV)], single, COMMIT_TOL)


def test_fp16_keys_with_inverse_norms():
    forest = forest_3()
    H_k, H_v, d = 2, 4, 16
    slots = torch.tensor([2, 1, 0])
    pool = torch.randn(3, H_v, d, d)
    f = make_factors(forest, pool[slots], H_k, H_v, d, d, seed=3, k_inv_norm=True,
                     dtype=torch.float16)
    assert f.k.dtype == torch.float16
    accepted = [8, 2, 6]
    exp = expected_pool(f, pool, slots, forest, accepted)
    pool_dev = pool.clone().to(DEV)
    commit_accepted(factors_to(f, DEV), pool_dev, slots.to(DEV), forest, accepted)
    assert_rel(pool_dev, exp, COMMIT_TOL)


def test_long_path_several_chunks_and_deep_decay():
    """A 40-node chain accepted at its end: 3 chunks of 16; g = -20 underflows e^{L_a}."""
    forest = PackedForest.pack([DraftTree.chain(40), DraftTree.star(3)])
    H_v, d = 2, 16
    N = forest.num_nodes
    g = torch.full((1, N, H_v), -20.0)
    g[..., 1] = -1e-3                                # one head barely decays
    slots = torch.tensor([0, 1])
    pool = torch.randn(2, H_v, d, d)
    f = make_factors(forest, pool[slots], 1, H_v, d, d, seed=4, g=g)
    assert float(f.log_decay.min()) < -700          # e^{L} alone is 0 in fp32 and fp64
    accepted = [39, 2]
    exp = expected_pool(f, pool, slots, forest, accepted)
    pool_dev = pool.clone().to(DEV)
    commit_accepted(factors_to(f, DEV), pool_dev, slots.to(DEV), forest, accepted,
                                    block_k=16)
    assert_rel(pool_dev, exp, COMMIT_TOL)


def test_skips_zero_length_and_negative_slot():
    forest = forest_3()
    H_v, d = 2, 16
    slots = torch.tensor([0, 1, 2])
    pool = torch.randn(3, H_v, d, d)
    f = make_factors(forest, pool[slots], 1, H_v, d, d, seed=5)
    accepted = [4, 3, 2]
    index, lengths = forest.padded_paths(accepted)
    exp = expected_pool(f, pool, slots, forest, accepted)
    lengths[1] = 0                                   # request 1: nothing to commit
    dev_slots = torch.tensor([0, 1, -1])             # request 2: padded request, no slot
    pool_dev = pool.clone().to(DEV)
    commit_factored_triton(factors_to(f, DEV), pool_dev, dev_slots.to(DEV), index.to(DEV),
                           lengths.to(DEV))
    assert_rel(pool_dev[0], exp[0], COMMIT_TOL)
    assert torch.equal(pool_dev.cpu()[1:], pool[1:])


def test_factored_commit_equals_copy_commit_of_serial_snapshots():
    """Bole's commit and the tree-serial copy-commit leave the same pool (two independent paths)."""
    forest = forest_3()
    H_k, H_v, d_k, d_v = 2, 4, 16, 16
    slots = torch.tensor([1, 3, 0])
    pool = torch.randn(4, H_v, d_k, d_v)
    x = layer_inputs(forest, H_k, H_v, d_k, d_v, seed=6)
    _, f = tree_gdn_closed_form(**x, forest=forest, initial_state=pool[slots],
                                use_qk_l2norm_in_kernel=True)
    _, snaps = tree_gdn_serial_triton(
        **{n: t.to(DEV) for n, t in x.items()}, meta=forest.kernel_meta(DEV),
        initial_state=pool.clone().to(DEV), state_indices=slots.to(DEV), use_qk_l2norm_in_kernel=True)
    accepted = [6, 5, 3]
    acc_global = forest.cu_nodes[:-1] + torch.tensor(accepted)
    pool_copy = pool.clone().to(DEV)
    commit_from_snapshots_triton(snaps, pool_copy, slots.to(DEV), acc_global.to(DEV))
    pool_fact = pool.clone().to(DEV)
    commit_accepted(factors_to(f, DEV), pool_fact, slots.to(DEV), forest, accepted)
    assert_rel(pool_fact, pool_copy, COMMIT_TOL)


def test_validation_errors():
    forest = forest_3()
    H_v, d = 2, 16
    slots = torch.tensor([0, 1, 2], device=DEV)
    pool = torch.randn(3, H_v, d, d)
    f = factors_to(make_factors(forest, pool, 1, H_v, d, d, seed=7), DEV)
    with pytest.raises(TypeError, match="fp32"):
        commit_accepted(f, pool.double().to(DEV), slots, forest, [0, 0, 0])
    with pytest.raises(ValueError, match="stacked factors"):
        commit_accepted(TreeFactors.stack([f, f]), pool.clone().to(DEV), slots, forest,
                                        [0, 0, 0])
    with pytest.raises(ValueError, match="state_pool has shape"):
        commit_accepted(f, torch.zeros(3, H_v, d, 8, device=DEV), slots, forest,
                                        [0, 0, 0])
    with pytest.raises(ValueError, match="repeat a slot"):
        commit_accepted(f, pool.clone().to(DEV), torch.tensor([0, 1, 0], device=DEV),
                                        forest, [0, 0, 0], check_values=True)
    with pytest.raises(ValueError, match="out of range"):
        commit_accepted(f, pool.clone().to(DEV), slots, forest, [0, 99, 0])
    with pytest.raises(ValueError, match="path_index holds node indices outside"):
        commit_accepted(f, pool.clone().to(DEV), slots, PackedForest.pack(
            [DraftTree.chain(3), DraftTree.chain(3), DraftTree.chain(30)]), [0, 0, 29],
            check_values=True)
