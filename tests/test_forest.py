"""DenseForest: the fixed-shape device layout against the host-built trees."""

import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from bole.forest import DenseForest
from bole.tree import PackedForest
from tests.kernel_utils import DEV
from tests.strategies import forests


@given(forest=forests(max_requests=4, max_nodes=20), extra=st.integers(0, 3), data=st.data())
@settings(max_examples=40)
def test_dense_layout_matches_the_packed_forest(forest, extra, data):
    T = int(forest.sizes().max()) + extra
    dense = DenseForest.from_packed(forest, T)
    R = forest.num_requests
    assert dense.parents.shape == (R, T)
    for r in range(R):
        tree = forest.tree(r)
        n = tree.num_nodes
        assert torch.equal(dense.depth[r, :n], tree.depth)
        assert torch.equal(dense.ancestors[r, :n, :n], tree.ancestor_mask())
        assert not dense.valid[r, n:].any() and (dense.parents[r, n:] == -1).all()
        # padding sees only itself
        assert torch.equal(dense.ancestors[r, n:, :], torch.eye(T, dtype=torch.bool)[n:])
    acc = torch.tensor([data.draw(st.integers(0, int(s) - 1)) for s in forest.sizes()])
    index, lengths = dense.paths(acc)
    for r in range(R):
        path = forest.tree(r).path(int(acc[r]))
        assert int(lengths[r]) == len(path)
        assert torch.equal(index[r, :len(path)], path)
        assert (index[r, len(path):] == acc[r]).all()
    meta = dense.kernel_meta()
    assert meta.cu_nodes.tolist() == [r * T for r in range(R + 1)]
    pg = meta.parent_global.long()
    for r in range(R):
        n = int(forest.sizes()[r])
        lo = int(forest.cu_nodes[r])
        want = torch.where(forest.parents[lo:lo + n] >= 0, forest.parents[lo:lo + n] + r * T, -1)
        assert torch.equal(pg[r * T: r * T + n], want)


def test_positions_and_global_index():
    forest = PackedForest.from_parents([np.array([-1, 0, 1]), np.array([-1, 0, 0, 1])])
    dense = DenseForest.from_packed(forest, 5)
    pos = dense.positions(torch.tensor([10, 20]))
    assert pos.tolist() == [10, 11, 12, 10, 10, 20, 21, 21, 22, 20]
    assert dense.global_index(torch.tensor([[0, 2], [1, 3]])).tolist() == [[0, 2], [6, 8]]


@given(forest=forests(max_requests=4, max_nodes=40), extra=st.integers(0, 3),
       cut=st.integers(0, 3))
@settings(max_examples=40)
def test_structure_kernel_equals_the_torch_propagation(forest, extra, cut):
    """bole/ops/forest/kernel.py (one launch; the CPU interpreter here) against the reference
    propagation, also with a max_depth below the trees' depth (both truncate alike)."""
    from bole.forest import ancestors_from_parents, depths_from_parents
    from bole.ops.forest.kernel import forest_structure
    T = int(forest.sizes().max()) + extra
    dense = DenseForest.from_packed(forest, T)
    parents = torch.where(dense.valid, dense.parents, -1)
    for D in {dense.max_depth, max(0, dense.max_depth - cut)}:
        depth, anc = forest_structure(parents.to(DEV), D)
        assert torch.equal(depth.cpu(), depths_from_parents(parents, D))
        assert torch.equal(anc.cpu(), ancestors_from_parents(parents, D))


def test_structure_kernel_over_several_row_blocks():
    """T = 130 (several row blocks a request): a long chain and a wide star, both truncated and
    not."""
    from bole.forest import ancestors_from_parents, depths_from_parents
    from bole.ops.forest.kernel import forest_structure
    chain = torch.arange(-1, 129)
    star = torch.tensor([-1] + [0] * 64 + list(range(1, 66)))
    parents = torch.stack([chain, star])
    for D in (129, 40):
        depth, anc = forest_structure(parents.to(DEV), D)
        assert torch.equal(depth.cpu(), depths_from_parents(parents, D))
        assert torch.equal(anc.cpu(), ancestors_from_parents(parents, D))
