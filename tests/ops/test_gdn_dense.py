"""The dense (fixed-shape) torch GDN path against the packed-forest oracles."""

import torch
from hypothesis import given, settings, strategies as st

from bole.forest import DenseForest
from bole.tree import PackedForest
from bole.ops.gdn.closed_form import TreeFactors, commit_factored, tree_gdn_closed_form
from bole.ops.gdn.dense import (commit_factored_paths, commit_snapshots,
                                tree_gdn_closed_form_dense, tree_gdn_serial_dense)
from bole.ops.gdn.reference import tree_gdn_serial
from tests.strategies import forests


def _inputs(forest, T, Hk, Hv, dk, dv, gen, dtype=torch.float64):
    R = forest.num_requests
    N = R * T
    x = dict(q=torch.randn(N, Hk, dk, generator=gen, dtype=dtype),
             k=torch.randn(N, Hk, dk, generator=gen, dtype=dtype),
             v=torch.randn(N, Hv, dv, generator=gen, dtype=dtype),
             a=torch.randn(N, Hv, generator=gen, dtype=dtype),
             b=torch.randn(N, Hv, generator=gen, dtype=dtype),
             A_log=torch.rand(Hv, generator=gen, dtype=dtype),
             dt_bias=torch.rand(Hv, generator=gen, dtype=dtype))
    pool = torch.randn(R + 2, Hv, dk, dv, generator=gen, dtype=dtype)
    slots = torch.randperm(R + 2, generator=gen)[:R]
    return x, pool, slots


def _packed_rows(forest, T):
    """Flat dense indices of the packed forest's nodes, in packed order."""
    return torch.cat([torch.arange(int(n)) + r * T for r, n in enumerate(forest.sizes())])


@given(forest=forests(max_requests=3, max_nodes=12), extra=st.integers(0, 2),
       seed=st.integers(0, 2**31 - 1), data=st.data())
@settings(max_examples=25)
def test_dense_closed_form_serial_and_commits_equal_the_oracles(forest, extra, seed, data):
    gen = torch.Generator().manual_seed(seed)
    forest = PackedForest.pack([forest.tree(r) for r in range(forest.num_requests)])  # no padding
    T = int(forest.sizes().max()) + extra
    dense = DenseForest.from_packed(forest, T)
    Hk, Hv, dk, dv = 1, 2, 4, 3
    x, pool, slots = _inputs(forest, T, Hk, Hv, dk, dv, gen)
    rows = _packed_rows(forest, T)
    gates = dict(a=x["a"], b=x["b"], A_log=x["A_log"], dt_bias=x["dt_bias"])
    o, f = tree_gdn_closed_form_dense(x["q"], x["k"], x["v"], **gates, state_pool=pool,
                                      slots=slots, ancestors=dense.ancestors)
    packed = {n: t[rows][None] for n, t in x.items() if n in "qkvab"}
    o_ref, f_ref = tree_gdn_closed_form(
        packed["q"], packed["k"], packed["v"], forest, a=packed["a"], b=packed["b"],
        A_log=x["A_log"], dt_bias=x["dt_bias"], initial_state=pool[slots],
        use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o[rows], o_ref[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(f.u[rows], f_ref.u, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(f.log_decay[rows], f_ref.log_decay, rtol=1e-12, atol=1e-12)
    o_s, snaps = tree_gdn_serial_dense(
        x["q"], x["k"], x["v"], **gates, state_pool=pool, slots=slots, parents=dense.parents,
        depth=dense.depth, max_depth=dense.max_depth)
    o_sr, _, states = tree_gdn_serial(
        packed["q"], packed["k"], packed["v"], forest, a=packed["a"], b=packed["b"],
        A_log=x["A_log"], dt_bias=x["dt_bias"], initial_state=pool[slots],
        use_qk_l2norm_in_kernel=True, return_states=True)
    torch.testing.assert_close(o_s[rows], o_sr[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(snaps[rows], states, rtol=1e-10, atol=1e-10)
    # commits: two layers stacked, against commit_factored and the snapshots
    acc = torch.tensor([data.draw(st.integers(0, int(n) - 1)) for n in forest.sizes()])
    index, lengths = dense.paths(acc)
    stacked = TreeFactors.stack([f, f])
    pool2 = torch.stack([pool, 2 * pool])
    got = commit_factored_paths(stacked, pool2.clone(), slots, dense.global_index(index), lengths)
    want = commit_factored(TreeFactors.stack([f_ref, f_ref]), pool2[:, slots], forest, acc.tolist())
    torch.testing.assert_close(got[:, slots], want, rtol=1e-10, atol=1e-10)
    untouched = torch.ones(pool.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(got[:, untouched], pool2[:, untouched])
    copied = commit_snapshots([snaps, snaps], pool2.clone(), slots, dense.global_index(acc))
    torch.testing.assert_close(copied[:, slots], torch.stack([states[_packed_index(forest, acc)]] * 2),
                               rtol=1e-10, atol=1e-10)
    assert torch.equal(copied[:, slots], torch.stack([snaps[dense.global_index(acc)]] * 2))


def _packed_index(forest, acc):
    return torch.tensor([int(forest.cu_nodes[r]) + int(a) for r, a in enumerate(acc)])
