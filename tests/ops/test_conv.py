"""Tree conv1d and conv-state commit against sequential decoding along each path."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from bole.ops.conv import conv_state_commit, tree_conv1d
from bole.tree import DraftTree, PackedForest
from tests.strategies import forests


def decode_along(x_path, state, w):
    """Token-by-token causal conv decode: returns (outputs [P, C], final state [C, K-1])."""
    outs = []
    for x_t in x_path:
        win = torch.cat([state, x_t[:, None]], dim=1)         # [C, K], oldest first
        outs.append(F.silu((win * w).sum(1)))
        state = win[:, 1:]
    return torch.stack(outs), state


@given(forest=forests(max_requests=3, max_nodes=24), K=st.sampled_from([2, 3, 4]),
       seed=st.integers(0, 2**31 - 1), data=st.data())
@settings(max_examples=40)
def test_tree_conv_and_commit_equal_sequential_decoding(forest, K, seed, data):
    gen = torch.Generator().manual_seed(seed)
    C = 5
    x = torch.randn(1, forest.num_nodes, C, generator=gen, dtype=torch.float64)
    w = torch.randn(C, K, generator=gen, dtype=torch.float64)
    state = torch.randn(forest.num_requests, C, K - 1, generator=gen, dtype=torch.float64)
    y = tree_conv1d(x, w, state, forest)
    for r in range(forest.num_requests):
        lo = int(forest.cu_nodes[r])
        tree = forest.tree(r)
        for node in range(tree.num_nodes):
            path = tree.path(node) + lo
            outs, _ = decode_along(x[0, path], state[r], w)
            assert torch.allclose(y[0, lo + node], outs[-1], atol=1e-12)
    assert not y[0, ~forest.valid].any()
    acc = [data.draw(st.integers(0, int(n) - 1)) for n in forest.sizes()]
    new = conv_state_commit(x, state, forest, acc)
    for r, a in enumerate(acc):
        path = forest.tree(r).path(a) + int(forest.cu_nodes[r])
        _, final = decode_along(x[0, path], state[r], w)
        assert torch.equal(new[r], final)
    same = state.clone()
    assert conv_state_commit(x, same, forest, acc, inplace=True) is same
    assert torch.equal(same, new)


def test_conv_accepts_hf_weight_layout_bias_and_no_activation():
    forest = PackedForest.pack([DraftTree.full_kary(2, 2)])
    x = torch.randn(1, 7, 3)
    w = torch.randn(3, 1, 4)
    bias = torch.randn(3)
    state = torch.randn(1, 3, 3)
    y = tree_conv1d(x, w, state, forest, bias=bias, activation=None)
    win = torch.cat([state[0], x[0, 0][:, None]], 1)
    assert torch.allclose(y[0, 0], (win * w[:, 0]).sum(1) + bias, atol=1e-6)


def test_conv_errors():
    forest = PackedForest.pack([DraftTree.chain(3)])
    x, w, s = torch.randn(1, 3, 4), torch.randn(4, 4), torch.randn(1, 4, 3)
    with pytest.raises(ValueError, match="nodes"):
        tree_conv1d(torch.randn(1, 5, 4), w, s, forest)
    with pytest.raises(ValueError, match="channels"):
        tree_conv1d(x, torch.randn(3, 4), s, forest)
    with pytest.raises(ValueError, match="conv_state"):
        tree_conv1d(x, w, torch.randn(1, 4, 2), forest)
    with pytest.raises(TypeError, match="dtype"):
        tree_conv1d(x, w, s.double(), forest)
    with pytest.raises(ValueError, match="activation"):
        tree_conv1d(x, w, s, forest, activation="gelu")
