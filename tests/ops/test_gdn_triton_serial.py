"""Triton kernels against the torch references (interpreted on CPU by tests/conftest.py)."""

import numpy as np
import pytest
import torch

from bole.ops.gdn.reference import chain_gdn_recurrent, tree_gdn_serial
from bole.ops.gdn.triton_serial import (
    chain_gdn_snapshots_triton,
    commit_from_snapshots_triton,
    serial_default_config,
    tree_gdn_serial_triton,
)
from bole.tree import DraftTree, PackedForest
from tests.kernel_utils import DEV, TOL, assert_rel
from tests.strategies import padded


def make_inputs(num_nodes, H_k, H_v, d_k, d_v, *, seed=0, dtype=torch.float32, raw=False,
                l2norm=True):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, num_nodes, H_k, d_k, generator=gen)
    k = torch.randn(1, num_nodes, H_k, d_k, generator=gen)
    if not l2norm:       # keep the delta rule stable (beta |k|^2 < 2) without in-kernel norms
        q, k = q / d_k ** 0.5, k / (k.norm(dim=-1, keepdim=True) + 1e-3)
    v = torch.randn(1, num_nodes, H_v, d_v, generator=gen)
    x = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype))
    if raw:
        x["a"] = 4 * torch.randn(1, num_nodes, H_v, generator=gen)
        x["a"][0, 0, 0] = 25.0                       # past the softplus threshold
        x["b"] = 3 * torch.randn(1, num_nodes, H_v, generator=gen)
        x["A_log"] = torch.randn(H_v, generator=gen) * 0.5
        x["dt_bias"] = torch.randn(H_v, generator=gen)
    else:
        x["g"] = -torch.rand(1, num_nodes, H_v, generator=gen) * 2
        x["beta"] = torch.rand(1, num_nodes, H_v, generator=gen)
    return x


def to_dev(x):
    return {n: t.to(DEV) for n, t in x.items()}


def run_and_check(forest, H_k=2, H_v=2, d_k=16, d_v=16, *, pool_slots=None, state_indices=None,
                  seed=0, l2norm=True, raw=False, dtype=torch.float32, overrides=None, tol=TOL,
                  **kernel_kwargs):
    """Run the kernel and the serial oracle; compare o and every valid snapshot."""
    R, N = forest.num_requests, forest.num_nodes
    x = make_inputs(N, H_k, H_v, d_k, d_v, seed=seed, dtype=dtype, raw=raw, l2norm=l2norm)
    if overrides:
        x.update(overrides)
    gen = torch.Generator().manual_seed(seed + 1)
    S = pool_slots or R
    pool = torch.randn(S, H_v, d_k, d_v, generator=gen) * 0.5
    si = torch.arange(R) if state_indices is None else torch.as_tensor(state_indices)
    o_ref, _, states_ref = tree_gdn_serial(
        **x, forest=forest, initial_state=pool[si], use_qk_l2norm_in_kernel=l2norm,
        return_states=True)
    pool_dev = pool.clone().to(DEV)
    o, snaps = tree_gdn_serial_triton(
        **to_dev(x), meta=forest.kernel_meta(DEV), initial_state=pool_dev,
        state_indices=None if state_indices is None else si.to(DEV),
        use_qk_l2norm_in_kernel=l2norm, **kernel_kwargs)
    assert o.dtype == x["v"].dtype and o.shape == x["v"].shape
    assert snaps.shape == (N, H_v, d_k, d_v) and snaps.dtype == torch.float32
    valid = forest.valid
    if dtype == torch.float32:
        assert_rel(o, o_ref, tol)
    else:
        assert_rel(o.float(), o_ref.float(), 2e-3)
    assert_rel(snaps[valid.to(DEV)], states_ref[valid], tol)
    assert (o[0, ~valid.to(DEV)] == 0).all()
    assert torch.equal(pool_dev.cpu(), pool)        # the pool is only read
    return o, snaps, x, pool


# ---------------------------------------------------------------- tree shapes

TREES = {
    "chain": lambda: DraftTree.chain(12),
    "star": lambda: DraftTree.star(10),
    "binary": lambda: DraftTree.full_kary(2, 3),
    "ternary": lambda: DraftTree.full_kary(3, 2),
    "random": lambda: DraftTree.random(20, 5, np.random.default_rng(3)),
    "root_only": lambda: DraftTree.chain(1),
}


@pytest.mark.parametrize("shape", sorted(TREES))
def test_single_tree_matches_serial_oracle(shape):
    run_and_check(PackedForest.pack([TREES[shape]()]))


@pytest.mark.parametrize("l2norm", [True, False])
def test_ragged_padded_forest_grouped_heads_pool(l2norm):
    rng = np.random.default_rng(1)
    forest = padded(PackedForest.pack(
        [DraftTree.random(9, 4, rng), DraftTree.chain(5), DraftTree.star(6)]), 24)
    run_and_check(forest, H_k=2, H_v=4, pool_slots=7, state_indices=[5, 0, 3], l2norm=l2norm,
                  seed=11)


def test_small_tree_and_random_forest():
    rng = np.random.default_rng(7)
    t = DraftTree.from_parents([-1, 0, 0, 1])
    forest = PackedForest.pack([t, DraftTree.random(14, 6, rng), DraftTree.full_kary(2, 2)])
    run_and_check(forest, H_k=1, H_v=2, d_k=32, d_v=16, seed=5)


def test_raw_gates_fused_in_kernel():
    rng = np.random.default_rng(2)
    forest = PackedForest.pack([DraftTree.random(10, 4, rng), DraftTree.chain(6)])
    run_and_check(forest, H_k=2, H_v=4, raw=True, seed=3)


@pytest.mark.parametrize("case", ["g_very_negative", "g_near_zero", "beta_near_0", "beta_near_1"])
def test_extreme_gates(case):
    forest = PackedForest.pack([DraftTree.full_kary(2, 3), DraftTree.chain(8)])
    N, H_v = forest.num_nodes, 2
    x = make_inputs(N, 2, H_v, 16, 16, seed=4)
    g, beta = x["g"], x["beta"]
    if case == "g_very_negative":
        g = torch.full_like(g, -20.0)
    elif case == "g_near_zero":
        g = -torch.rand_like(g) * 1e-7
    elif case == "beta_near_0":
        beta = torch.full_like(beta, 1e-7)
    else:
        beta = torch.full_like(beta, 1.0 - 1e-7)
    run_and_check(forest, overrides={"g": g, "beta": beta}, seed=4)


def test_fp16_inputs():
    rng = np.random.default_rng(5)
    forest = padded(PackedForest.pack([DraftTree.random(12, 4, rng), DraftTree.star(5)]), 20)
    run_and_check(forest, H_k=2, H_v=4, dtype=torch.float16, seed=6)


@pytest.mark.parametrize("block_v,num_warps,always_reload", [(8, 1, True), (16, 2, False),
                                                             (32, 4, False)])
def test_launch_configs_agree(block_v, num_warps, always_reload):
    rng = np.random.default_rng(9)
    forest = PackedForest.pack([DraftTree.random(12, 5, rng), DraftTree.chain(4)])
    run_and_check(forest, H_k=1, H_v=2, d_k=16, d_v=32, block_v=block_v, num_warps=num_warps,
                  always_reload=always_reload, seed=8)


def test_non_power_of_two_head_dims():
    forest = PackedForest.pack([DraftTree.full_kary(2, 2), DraftTree.chain(3)])
    run_and_check(forest, H_k=1, H_v=1, d_k=12, d_v=20, seed=12)


def test_zero_initial_state_and_negative_slot():
    forest = PackedForest.pack([DraftTree.star(5), DraftTree.chain(4)])
    N = forest.num_nodes
    x = to_dev(make_inputs(N, 1, 2, 16, 16, seed=13))
    meta = forest.kernel_meta(DEV)
    o_none, s_none = tree_gdn_serial_triton(**x, meta=meta, initial_state=None)
    pool = torch.randn(3, 2, 16, 16, device=DEV)
    o_neg, s_neg = tree_gdn_serial_triton(**x, meta=meta, initial_state=pool,
                                          state_indices=torch.tensor([-1, -1], device=DEV))
    o_ref, _, st_ref = tree_gdn_serial(**{n: t.cpu() for n, t in x.items()}, forest=forest,
                                       return_states=True)
    for o, s in ((o_none, s_none), (o_neg, s_neg)):
        assert_rel(o, o_ref)
        assert_rel(s, st_ref)


def test_snapshot_buffer_reused_and_scale():
    forest = PackedForest.pack([DraftTree.full_kary(2, 2)])
    N = forest.num_nodes
    x = make_inputs(N, 1, 1, 16, 16, seed=14)
    pool = torch.randn(1, 1, 16, 16)
    buf = torch.full((N, 1, 16, 16), float("nan"), device=DEV)
    o, snaps = tree_gdn_serial_triton(**to_dev(x), meta=forest.kernel_meta(DEV),
                                      initial_state=pool.clone().to(DEV), snapshots=buf, scale=0.3)
    assert snaps.data_ptr() == buf.data_ptr()
    o_ref, _, st = tree_gdn_serial(**x, forest=forest, initial_state=pool, scale=0.3,
                                   return_states=True)
    assert_rel(o, o_ref)
    assert_rel(buf, st)


# ---------------------------------------------------------------- chain entry


@pytest.mark.parametrize("l2norm", [True, False])
def test_chain_entry_matches_recurrence(l2norm):
    B, T, H_k, H_v, d = 2, 6, 1, 2, 16
    x = make_inputs(B * T, H_k, H_v, d, d, seed=15, l2norm=l2norm)
    x = {n: t.reshape(B, T, *t.shape[2:]) for n, t in x.items()}
    pool = torch.randn(4, H_v, d, d)
    si = torch.tensor([2, 0])
    o, snaps = chain_gdn_snapshots_triton(**to_dev(x), initial_state=pool.clone().to(DEV),
                                          state_indices=si.to(DEV), use_qk_l2norm_in_kernel=l2norm)
    assert o.shape == (B, T, H_v, d) and snaps.shape == (B, T, H_v, d, d)
    forest = PackedForest.from_parents(torch.arange(-1, T - 1).expand(B, T))
    o_ref, _, st = tree_gdn_serial(**x, forest=forest, initial_state=pool[si],
                                   use_qk_l2norm_in_kernel=l2norm, return_states=True)
    assert_rel(o, o_ref)
    assert_rel(snaps, st.reshape(B, T, H_v, d, d))
    o2, final = chain_gdn_recurrent(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                    initial_state=pool[si], use_qk_l2norm_in_kernel=l2norm)
    assert_rel(snaps[:, -1], final)
    # the tree kernel on the chain forest gives the same (a chain never reloads)
    o3, snaps3 = tree_gdn_serial_triton(
        **{n: t.reshape(1, B * T, *t.shape[2:]) for n, t in to_dev(x).items()},
        meta=forest.kernel_meta(DEV), initial_state=pool.clone().to(DEV), state_indices=si.to(DEV),
        use_qk_l2norm_in_kernel=l2norm)
    assert_rel(o3.reshape(o.shape), o)
    assert_rel(snaps3.reshape(snaps.shape), snaps)


def test_chain_entry_raw_gates():
    B, T = 2, 4
    x = make_inputs(B * T, 2, 4, 16, 16, seed=16, raw=True)
    x = {n: (t.reshape(B, T, *t.shape[2:]) if t.dim() > 1 else t) for n, t in x.items()}
    o, snaps = chain_gdn_snapshots_triton(**to_dev(x), initial_state=None)
    forest = PackedForest.from_parents(torch.arange(-1, T - 1).expand(B, T))
    o_ref, _, st = tree_gdn_serial(**x, forest=forest, return_states=True)
    assert_rel(o, o_ref)
    assert_rel(snaps.reshape(B * T, 4, 16, 16), st)


# ---------------------------------------------------------------- copy-commit


def test_copy_commit_tree():
    rng = np.random.default_rng(17)
    forest = padded(PackedForest.pack([DraftTree.random(8, 3, rng), DraftTree.star(4),
                                DraftTree.chain(5)]), 20)
    _, snaps, _, pool = run_and_check(forest, H_k=1, H_v=2, pool_slots=6,
                                      state_indices=[4, 1, 2], seed=17)
    accepted = [5, 2, 4]
    acc_global = forest.cu_nodes[:-1] + torch.tensor(accepted)
    slots = torch.tensor([4, 1, 2])
    new_pool = pool.clone().to(DEV)
    out = commit_from_snapshots_triton(snaps, new_pool, slots.to(DEV), acc_global.to(DEV))
    assert out is new_pool
    expected = pool.clone()
    expected[slots] = snaps.cpu()[acc_global]
    assert torch.equal(new_pool.cpu(), expected)


def test_copy_commit_layers_chain_shape_and_skips():
    Ly, B, T, H_v, d = 3, 2, 4, 2, 16
    snaps = torch.randn(Ly, B, T, H_v, d, d, device=DEV)
    pool = torch.randn(Ly, 5, H_v, d, d, device=DEV)
    before = pool.clone()
    slots = torch.tensor([3, -1], device=DEV)          # request 1 skipped (padded request)
    acc = torch.tensor([0 * T + 2, 1 * T + 3], device=DEV)
    commit_from_snapshots_triton(snaps, pool, slots, acc)
    expected = before.clone()
    expected[:, 3] = snaps[:, 0, 2]
    assert torch.equal(pool, expected)
    # single layer, chain-shaped snapshots [B, T, ...]
    pool1 = before[0].clone()
    commit_from_snapshots_triton(snaps[0], pool1, torch.tensor([1, 4], device=DEV),
                                 torch.tensor([1, T + 0], device=DEV))
    expected1 = before[0].clone()
    expected1[1], expected1[4] = snaps[0, 0, 1], snaps[0, 1, 0]
    assert torch.equal(pool1, expected1)


# ---------------------------------------------------------------- validation


def _torch_error(**kw):
    forest = kw.pop("forest")
    with pytest.raises(Exception) as info:
        tree_gdn_serial(forest=forest, **kw)
    return info.type, str(info.value)


@pytest.mark.parametrize("case", ["bad_heads", "no_gates", "both_gates", "bad_g_shape",
                                  "nan_values", "positive_g", "bad_dtype", "node_count"])
def test_errors_match_torch_path(case):
    forest = PackedForest.pack([DraftTree.star(4)])
    x = make_inputs(4, 2, 4, 16, 16, seed=18)
    if case == "bad_heads":
        x["v"] = torch.randn(1, 4, 3, 16)
        x["g"], x["beta"] = x["g"][..., :3], x["beta"][..., :3]
    elif case == "no_gates":
        del x["g"], x["beta"]
    elif case == "both_gates":
        x["a"] = x["g"].clone()
        x["b"] = x["beta"].clone()
    elif case == "bad_g_shape":
        x["g"] = x["g"][:, :3]
    elif case == "nan_values":
        x["v"][0, 1, 0, 0] = float("nan")
    elif case == "positive_g":
        x["g"][0, 2, 1] = 0.5
    elif case == "bad_dtype":
        x["q"] = x["q"].to(torch.int32)
    elif case == "node_count":
        forest = PackedForest.pack([DraftTree.star(5)])
    check = case in ("nan_values", "positive_g")
    etype, msg = _torch_error(forest=forest, **x)
    with pytest.raises(etype) as info:
        tree_gdn_serial_triton(**to_dev(x), meta=forest.kernel_meta(DEV), initial_state=None,
                               check_values=check)
    assert str(info.value) == msg


def test_default_config_is_the_engines():
    assert serial_default_config(128) == {"block_v": 8, "num_warps": 1, "num_stages": 3}
    assert serial_default_config(4)["block_v"] == 4


def test_pool_shape_and_dtype_errors():
    forest = PackedForest.pack([DraftTree.star(4)])
    x = to_dev(make_inputs(4, 1, 2, 16, 16, seed=19))
    meta = forest.kernel_meta(DEV)
    with pytest.raises(TypeError, match="fp32"):
        tree_gdn_serial_triton(**x, meta=meta,
                               initial_state=torch.zeros(1, 2, 16, 16, dtype=torch.float64,
                                                         device=DEV))
    with pytest.raises(ValueError, match="state pool"):
        tree_gdn_serial_triton(**x, meta=meta, initial_state=torch.zeros(1, 2, 16, 8, device=DEV))
    with pytest.raises(ValueError, match="state_indices"):
        tree_gdn_serial_triton(**x, meta=meta, initial_state=torch.zeros(3, 2, 16, 16, device=DEV),
                               state_indices=torch.tensor([0, 1], device=DEV))
