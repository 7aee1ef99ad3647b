"""Property tests: the closed form and the factored commit against the serial recurrence.

Random trees (chains, stars, k-ary, random, deep, wide, ragged forests with padding), T up to 128,
depth up to T; gates with g near 0 and g = -20, beta near 0 and near 1.
"""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from bole.ops.gdn.closed_form import (TreeFactors, commit_factored, solve_unit_lower,
                                      tree_gdn_closed_form, tree_states_from_factors)
from bole.ops.gdn.reference import tree_gdn_serial
from bole.tree import DraftTree, PackedForest
from tests.strategies import GATE_REGIMES, forests, gdn_inputs, trees


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def rel_fp32(o32, o_ref, x, forest):
    """fp32 error of o relative to the size of the products that form it: the closed form on
    non-negative q, k, v and state, where nothing cancels. o itself can be far smaller (q . k of
    nearly orthogonal vectors): fp32 rounding is relative to the products, not to their sum."""
    positive = {n: (t.abs() if n in ("q", "k", "v", "initial_state") else t) for n, t in x.items()}
    size = max(float(o_ref.double().norm()),
               float(tree_gdn_closed_form(forest=forest, **positive)[0].double().norm()), 1e-300)
    return float((o32.double() - o_ref.double()).norm()) / size


heads = st.sampled_from([(1, 1, 4, 3), (2, 4, 8, 4), (1, 3, 5, 6)])   # H_k, H_v, d_k, d_v


@given(tree=trees(max_nodes=128), regime=st.sampled_from(GATE_REGIMES), dims=heads,
       seed=st.integers(0, 2**31 - 1))
@settings(max_examples=60)
def test_single_tree_fp64_and_fp32(tree, regime, dims, seed):
    forest = PackedForest.pack([tree])
    x = gdn_inputs(forest, *dims, seed=seed, regime=regime)
    o_ref, u_ref, states = tree_gdn_serial(forest=forest, return_states=True, **x)
    o64, f64 = tree_gdn_closed_form(forest=forest, **x)
    assert rel(o64, o_ref) <= 1e-10
    assert rel(f64.u, u_ref) <= 1e-10
    x32 = {n: t.float() for n, t in x.items()}
    o32, f32 = tree_gdn_closed_form(forest=forest, **x32)
    assert o32.dtype == torch.float32 and f32.u.dtype == torch.float32
    assert rel_fp32(o32, o_ref, x, forest) <= 1e-5
    # Commit of every node (each could be the accepted one) equals its serial state.
    for factors, tol in ((f64, 1e-10), (f32, 1e-5)):
        for a in {0, tree.num_nodes - 1, int(tree.depth.argmax())}:
            s = commit_factored(factors, x["initial_state"].to(factors.u.dtype), forest, [a])
            assert rel(s[0], states[a]) <= tol


@given(forest=forests(max_requests=3, max_nodes=40), regime=st.sampled_from(GATE_REGIMES),
       dims=heads, seed=st.integers(0, 2**31 - 1), data=st.data())
@settings(max_examples=40)
def test_forest_and_batched_commit(forest, regime, dims, seed, data):
    x = gdn_inputs(forest, *dims, seed=seed, regime=regime)
    o_ref, u_ref, states = tree_gdn_serial(forest=forest, return_states=True, **x)
    o, f = tree_gdn_closed_form(forest=forest, **x)
    assert rel(o, o_ref) <= 1e-10
    pad = ~forest.valid
    assert not o[0, pad].any() and not f.u[pad].any()       # padding stays zero
    acc = [data.draw(st.integers(0, int(n) - 1)) for n in forest.sizes()]
    new = commit_factored(f, x["initial_state"], forest, acc)
    glob = [int(forest.cu_nodes[r]) + a for r, a in enumerate(acc)]
    assert rel(new, states[glob]) <= 1e-10
    # Lemma 1: every node's state is recoverable from the factors.
    assert rel(tree_states_from_factors(f, x["initial_state"], forest)[forest.valid],
               states[forest.valid]) <= 1e-10


@given(forest=forests(max_requests=3, max_nodes=24), seed=st.integers(0, 2**31 - 1), data=st.data())
@settings(max_examples=20)
def test_cross_layer_commit_in_place(forest, seed, data):
    layers = 3
    xs = [gdn_inputs(forest, 2, 4, 8, 4, seed=seed + i) for i in range(layers)]
    outs = [tree_gdn_closed_form(forest=forest, **x) for x in xs]
    stacked = TreeFactors.stack([f for _, f in outs])
    pool = torch.stack([x["initial_state"] for x in xs])           # [L, R, H_v, d_k, d_v]
    acc = [data.draw(st.integers(0, int(n) - 1)) for n in forest.sizes()]
    expect = torch.stack([commit_factored(f, x["initial_state"], forest, acc)
                          for (_, f), x in zip(outs, xs)])
    got = commit_factored(stacked, pool, forest, acc, inplace=True)
    assert got is pool
    assert rel(pool, expect) <= 1e-12


@pytest.mark.parametrize("method", ["neumann", "squaring", "substitution"])
@given(tree=trees(max_nodes=64), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=15)
def test_solvers_agree(method, tree, seed):
    from bole.ops.gdn.closed_form import SQUARING_MAX_DEPTH
    if method == "squaring" and tree.max_depth > SQUARING_MAX_DEPTH:
        return                     # refused there (test_deep_chains_..._stay_finite_in_fp32)
    forest = PackedForest.pack([tree])
    x = gdn_inputs(forest, 2, 4, 8, 4, seed=seed)
    o_ref, _, _ = tree_gdn_serial(forest=forest, **x)
    o, _ = tree_gdn_closed_form(forest=forest, solve=method, **x)
    assert rel(o, o_ref) <= 1e-10


def test_neumann_needs_exactly_depth_sweeps():
    """The bounded solve is exact after `depth` sweeps and not before (the bound is tight)."""
    gen = torch.Generator().manual_seed(0)
    tree = DraftTree.chain(6)
    G = torch.tril(torch.randn(6, 6, generator=gen, dtype=torch.float64), -1)
    R = torch.randn(6, 3, generator=gen, dtype=torch.float64)
    exact = solve_unit_lower(G, R, tree.max_depth, "substitution")
    assert torch.allclose(solve_unit_lower(G, R, tree.max_depth, "neumann"), exact, atol=1e-12)
    assert torch.allclose(solve_unit_lower(G, R, tree.max_depth, "squaring"), exact, atol=1e-12)
    assert not torch.allclose(solve_unit_lower(G, R, tree.max_depth - 1, "neumann"), exact)
    with pytest.raises(ValueError, match="unknown solve method"):
        solve_unit_lower(G, R, 5, "magic")


@given(forest=forests(max_requests=2, max_nodes=20), seed=st.integers(0, 2**31 - 1),
       l2=st.booleans())
@settings(max_examples=20)
def test_raw_gates_and_l2norm(forest, seed, l2):
    gen = torch.Generator().manual_seed(seed)
    N, R, Hk, Hv, dk, dv = forest.num_nodes, forest.num_requests, 2, 4, 8, 4
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = rnd(1, N, Hk, dk), rnd(1, N, Hk, dk), rnd(1, N, Hv, dv)
    if not l2:
        k = k / k.norm(dim=-1, keepdim=True)
    a, b = rnd(1, N, Hv) * 3, rnd(1, N, Hv) * 3
    A_log, dt_bias = rnd(Hv), rnd(Hv)
    S = rnd(R, Hv, dk, dv)
    raw = dict(a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    g = -torch.exp(A_log) * torch.nn.functional.softplus(a + dt_bias)
    beta = torch.sigmoid(b)
    o_ref, _, _ = tree_gdn_serial(q, k, v, forest, g=g, beta=beta, initial_state=S,
                                  use_qk_l2norm_in_kernel=l2, scale=0.3)
    o, _ = tree_gdn_closed_form(q, k, v, forest, initial_state=S, use_qk_l2norm_in_kernel=l2,
                                scale=0.3, **raw)
    assert rel(o, o_ref) <= 1e-10


def test_fp16_and_bf16_inputs_compute_in_fp32():
    forest = PackedForest.pack([DraftTree.full_kary(2, 3)])
    x = gdn_inputs(forest, 2, 4, 8, 4, seed=1)
    o_ref, _, _ = tree_gdn_serial(forest=forest, **x)
    for dt in (torch.float16, torch.bfloat16):
        xi = {n: (t.to(dt) if n in "qkv" else t.float()) for n, t in x.items()}
        o, f = tree_gdn_closed_form(forest=forest, **xi)
        assert o.dtype == dt and f.u.dtype == torch.float32
        up = {n: t.double() for n, t in xi.items()}
        o_up, _, _ = tree_gdn_serial(forest=forest, **up)
        # O carries its dtype's output rounding; U and L are fp32 from exact 16-bit inputs
        assert rel(o, o_up) <= (1e-3 if dt == torch.float16 else 1e-2)
        _, f_up = tree_gdn_closed_form(forest=forest, **up)
        assert rel(f.u, f_up.u) <= 1e-6 and rel(f.log_decay, f_up.log_decay) <= 1e-6


def test_initial_state_is_not_written():
    forest = PackedForest.pack([DraftTree.full_kary(3, 2), DraftTree.chain(4)])
    x = gdn_inputs(forest, 2, 4, 8, 4, seed=3, dtype=torch.float32)
    before = x["initial_state"].clone()
    tree_gdn_closed_form(forest=forest, **x)
    assert torch.equal(before, x["initial_state"])


@pytest.mark.parametrize("make", [
    lambda rng: DraftTree.chain(128),                        # depth 127
    lambda rng: DraftTree.random(128, 127, rng),
    lambda rng: DraftTree.random(128, 8, rng),                 # EAGLE-like
    lambda rng: DraftTree.star(128),
    lambda rng: DraftTree.full_kary(2, 6),                     # 127 nodes
], ids=["chain128", "random128-deep", "random128-d8", "star128", "binary127"])
@pytest.mark.parametrize("regime", GATE_REGIMES)
def test_large_trees_explicitly(make, regime):
    import numpy as np
    tree = make(np.random.default_rng(7))
    forest = PackedForest.pack([tree])
    x = gdn_inputs(forest, 2, 4, 8, 4, seed=11, regime=regime)
    o_ref, _, states = tree_gdn_serial(forest=forest, return_states=True, **x)
    o64, f64 = tree_gdn_closed_form(forest=forest, **x)
    assert rel(o64, o_ref) <= 1e-10
    o32, f32 = tree_gdn_closed_form(forest=forest, **{n: t.float() for n, t in x.items()})
    assert rel(o32, o_ref) <= 1e-5
    a = int(tree.depth.argmax())
    s = commit_factored(f32, x["initial_state"].float(), forest, [a])
    assert rel(s[0], states[a]) <= 1e-5


def test_deep_chains_of_near_parallel_keys_stay_finite_in_fp32():
    """The Neumann iterates grow like (1 + beta)^depth before converging: on a 200-node chain of
    near-parallel keys with g = 0 and beta = 1 they overflow fp32. The fp32 closed form then
    solves by substitution and stays within fp32 rounding of fp64; the Triton kernel refuses
    such depths with a clear error instead of returning inf/NaN."""
    from bole.ops.gdn.closed_form import NEUMANN_MAX_DEPTH_FP32, solve_unit_lower
    T = 200
    forest = PackedForest.pack([DraftTree.chain(T)])
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 1, 1, 16, generator=gen) + 1e-3 * torch.randn(1, T, 1, 16, generator=gen)
    q, v = torch.randn(1, T, 1, 16, generator=gen), torch.randn(1, T, 2, 16, generator=gen)
    g, beta = torch.zeros(1, T, 2), torch.ones(1, T, 2)
    o, _ = tree_gdn_closed_form(q, k, v, forest, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    o64, _ = tree_gdn_closed_form(q.double(), k.double(), v.double(), forest, g=g.double(),
                                  beta=beta.double(), use_qk_l2norm_in_kernel=True)
    assert torch.isfinite(o).all()
    assert float((o.double() - o64).abs().max()) < 1e-5
    with pytest.raises(ValueError, match="squaring"):
        solve_unit_lower(torch.zeros(40, 40), torch.ones(40, 2), 39, "squaring")
    from bole.ops.gdn.verify.kernel import tree_gdn_verify_triton
    from tests.kernel_utils import DEV
    deep = PackedForest.pack([DraftTree.chain(NEUMANN_MAX_DEPTH_FP32 + 2)])
    with pytest.raises(ValueError, match="overflow"):
        n = deep.num_nodes
        z = dict(device=DEV)
        tree_gdn_verify_triton(torch.zeros(1, n, 1, 16, **z), torch.zeros(1, n, 1, 16, **z),
                               torch.zeros(1, n, 2, 16, **z), deep.kernel_meta(DEV),
                               g=torch.zeros(1, n, 2, **z), beta=torch.ones(1, n, 2, **z),
                               initial_state=torch.zeros(1, 2, 16, 16, **z))
