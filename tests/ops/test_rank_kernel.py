"""The dense ranking's Triton kernels (bole/ops/rank/kernel.py; the CPU interpreter here,
compiled on a GPU) against the torch ranking, field for field: random forests with tied, NaN
and non-monotone rho, padding, inactive rows, several floors."""

import numpy as np
import pytest
import torch

from bole.forest import DenseForest
from bole.speculative.budget.expected import expected_accepted_curve
from bole.speculative.budget.ranking import _keep, dense_inputs, rank_nodes, Ranking
from bole.ops.rank.kernel import rank_dense_triton
from bole.tree import DraftTree, PackedForest
from tests.kernel_utils import DEV

FIELDS = ("order", "eligible", "root", "floor", "score")


def _case(seed: int):
    rng = np.random.default_rng(seed)
    R, T, D = int(rng.integers(1, 7)), int(rng.integers(1, 40)), int(rng.integers(1, 9))
    trees = [DraftTree.random(int(rng.integers(1, T + 1)), D, rng) for _ in range(R)]
    dense = DenseForest.from_packed(PackedForest.pack(trees), T, device=DEV)
    values = [0.0, 0.1, 0.25, 0.5, 1.0, float("nan"), -0.0, 0.3]
    rho = torch.tensor(rng.choice(values, size=(R, T)), dtype=torch.float64, device=DEV)
    if seed % 3 == 0:                         # cumulative (non-increasing down paths), distinct
        rho = torch.rand(R, T, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        rho = rho.to(DEV)
    active = torch.tensor(rng.random(R) < 0.75, device=DEV)
    return dense, rho, active


def _torch_ranking(rho, dense, root_floor, active):
    parents, request = dense_inputs(dense, active)
    return rank_nodes(rho.reshape(-1), parents, request, root_floor, max_depth=dense.max_depth)


@pytest.mark.parametrize("seed", range(24))
@pytest.mark.parametrize("root_floor", [0, 1, 3])
def test_the_kernels_rank_as_the_torch_code(seed, root_floor):
    dense, rho, active = _case(seed)
    for act in (None, active):
        want = _torch_ranking(rho, dense, root_floor, act)
        got = Ranking(*rank_dense_triton(rho, dense.parents, dense.valid, act, root_floor,
                                         dense.max_depth))
        for field in FIELDS:
            assert torch.equal(getattr(got, field), getattr(want, field)), field
        # and so every budget keeps the same nodes and estimates the same tokens
        for budget in (0, 1, 5, 1000):
            assert torch.equal(_keep(got, budget), _keep(want, budget))
        grid = torch.tensor([1, 4, 16, 64], device=DEV)
        assert torch.equal(expected_accepted_curve(rho.reshape(-1), None, None, grid, root_floor,
                                                   rank=got),
                           expected_accepted_curve(rho.reshape(-1), None, None, grid, root_floor,
                                                   rank=want))


def test_shapes_and_floors_are_checked():
    rho = torch.zeros(2, 3, dtype=torch.float64, device=DEV)
    parents = torch.full((2, 3), -1, dtype=torch.int64, device=DEV)
    valid = torch.ones(2, 3, dtype=torch.bool, device=DEV)
    with pytest.raises(ValueError, match="must all be \\[R, T\\]"):
        rank_dense_triton(rho, parents[:, :2], valid, None, 1, 2)
    with pytest.raises(ValueError, match="root_floor"):
        rank_dense_triton(rho, parents, valid, None, -1, 2)
