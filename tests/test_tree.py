"""Draft trees and packed forests: construction, validation errors and derived structure."""

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from bole.tree import DraftTree, PackedForest
from tests.strategies import forests, trees


def brute_ancestors(parents, i, include_self=True):
    out = {i} if include_self else set()
    p = parents[i]
    while p != -1:
        out.add(p)
        p = parents[p]
    return out


@given(trees())
def test_derived_structure_matches_brute_force(tree):
    parents = tree.parents.tolist()
    T = tree.num_nodes
    mask = tree.ancestor_mask(include_self=True)
    strict = tree.ancestor_mask(include_self=False)
    for i in range(T):
        anc = brute_ancestors(parents, i)
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == anc
        assert set(torch.nonzero(strict[i]).flatten().tolist()) == anc - {i}
        assert int(tree.depth[i]) == len(anc) - 1
        assert tree.path(i).tolist() == sorted(anc)
    assert tree.positions(100).tolist() == [100 + d for d in tree.depth.tolist()]
    assert tree.max_depth == max(len(brute_ancestors(parents, i)) - 1 for i in range(T))


@given(forests(max_requests=4, max_nodes=20))
def test_packed_forest_structure(forest):
    assert forest.num_valid_nodes == int(forest.cu_nodes[-1])
    for i in range(forest.num_nodes):
        r = int(forest.request[i])
        if r < 0:
            assert not forest.valid[i] and int(forest.parent_global[i]) == -1
            continue
        lo = int(forest.cu_nodes[r])
        p = int(forest.parents[i])
        assert int(forest.parent_global[i]) == (-1 if p < 0 else lo + p)
    lens = list(range(forest.num_requests))
    pos = forest.positions(lens)
    assert torch.equal(pos[forest.valid], (torch.tensor(lens)[forest.request[forest.valid]]
                                           + forest.depth[forest.valid]))
    meta = forest.kernel_meta()
    assert meta.block_nodes >= int(forest.sizes().max()) and meta.block_nodes >= 16
    for r in range(forest.num_requests):
        lo, hi = int(forest.cu_nodes[r]), int(forest.cu_nodes[r + 1])
        assert torch.equal(meta.ancestor_mask[lo:hi, : hi - lo].bool(), forest.tree(r).ancestor_mask())
        assert not meta.ancestor_mask[lo:hi, hi - lo:].any()
    assert not meta.ancestor_mask[forest.num_valid_nodes:].any()          # padding rows


@given(forests(max_requests=3, max_nodes=20), st.data())
def test_accepted_paths(forest, data):
    acc = [data.draw(st.integers(0, int(n) - 1)) for n in forest.sizes()]
    nodes, cu = forest.accepted_paths(acc)
    index, lengths = forest.padded_paths(acc)
    for r, a in enumerate(acc):
        lo = int(forest.cu_nodes[r])
        path = (forest.tree(r).path(a) + lo).tolist()
        assert nodes[cu[r]: cu[r + 1]].tolist() == path
        assert index[r, : lengths[r]].tolist() == path
        assert path[0] == lo                     # the root is always on the path


def test_uniform_batch_from_2d_parents():
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]])
    f = PackedForest.from_parents(parents)
    assert f.cu_nodes.tolist() == [0, 4, 8]
    assert f.parent_global.tolist() == [-1, 0, 0, 1, -1, 4, 5, 6]


def test_shapes_constructors():
    assert DraftTree.full_kary(2, 3).num_nodes == 15
    assert DraftTree.full_kary(2, 3).max_depth == 3
    assert DraftTree.star(5).max_depth == 1
    assert DraftTree.chain(5).max_depth == 4
    rng = np.random.default_rng(0)
    t = DraftTree.random(50, 4, rng)
    assert t.num_nodes == 50 and t.max_depth <= 4


# ---- malformed trees: each raises a ValueError/TypeError whose message names the problem ----

@pytest.mark.parametrize("parents, pattern", [
    ([], "at least its root"),
    ([0, 0], "node 0 must be the root"),
    ([-1, 0, -1], "second root"),
    ([-1, 0, 5], "out of range"),
    ([-1, 0, -3], "out of range"),
    ([-1, 2, 0], "does not precede"),          # parent after child
    ([-1, 1], "does not precede"),             # self loop
    ([-1, 2, 1], "does not precede"),          # cycle 1 <-> 2
])
def test_malformed_parent_arrays(parents, pattern):
    with pytest.raises(ValueError, match=pattern):
        DraftTree.from_parents(parents)


def test_depth_limit():
    DraftTree.from_parents([-1, 0, 1, 2], max_depth=3)
    with pytest.raises(ValueError, match="depth 3 .* exceeds the limit max_depth=2"):
        DraftTree.from_parents([-1, 0, 1, 2], max_depth=2)


def test_wrong_types_and_ranks():
    with pytest.raises(TypeError, match="integers"):
        DraftTree.from_parents(torch.tensor([-1.0, 0.0]))
    with pytest.raises(ValueError, match="1-D"):
        DraftTree.from_parents([[-1, 0]])
    with pytest.raises(TypeError, match="DraftTree"):
        PackedForest.pack([[-1, 0]])
    with pytest.raises(ValueError, match="empty batch"):
        PackedForest.pack([])


def test_forest_errors():
    f = PackedForest.pack([DraftTree.chain(3), DraftTree.star(2)])
    with pytest.raises(ValueError, match="one node per request"):
        f.accepted_paths([0])
    with pytest.raises(ValueError, match="out of range"):
        f.accepted_paths([3, 0])
    with pytest.raises(ValueError, match="one entry per request"):
        f.positions([1, 2, 3])
