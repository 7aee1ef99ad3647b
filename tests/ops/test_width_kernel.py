"""Goodput's width choice in Triton (bole/ops/width/kernel.py; the CPU interpreter here,
compiled on a GPU) against the torch choice (budget.width_fill_choice): random forests with
tied, NaN and non-monotone rho, padding, inactive rows, several floors, acceptance maps,
verify curves of every slope and forward widths narrower than the choice."""

import numpy as np
import pytest
import torch

from bole.forest import DenseForest
from bole.speculative.budget.expected import (_estimates, goodput_best, RowFill,
                                              width_fill_choice, width_fill_curve, WidthChoice)
from bole.speculative.budget.ranking import rank_dense
from bole.speculative.budget.acceptance import AcceptanceCalibrator
from bole.ops.width.kernel import width_fill_choice_triton as _width_kernel
from bole.tree import DraftTree, PackedForest
from tests.kernel_utils import DEV


def width_fill_choice_triton(rank, rows, *args, **kwargs) -> WidthChoice:
    """The kernel on a :class:`Ranking`, its result as a :class:`WidthChoice`."""
    return WidthChoice(*_width_kernel(rank.order, rank.eligible, rank.root, rank.floor, rows,
                                      *args, **kwargs))


def _case(seed: int, T: int | None = None):
    rng = np.random.default_rng(seed)
    R, D = int(rng.integers(1, 6)), int(rng.integers(1, 9))
    T = int(rng.integers(2, 33)) if T is None else T
    trees = [DraftTree.random(int(rng.integers(1, T + 1)), D, rng) for _ in range(R)]
    dense = DenseForest.from_packed(PackedForest.pack(trees), T, device=DEV)
    if seed % 3:
        values = [0.0, 0.1, 0.25, 0.5, 1.0, float("nan"), 0.3, 0.9]
        rho = torch.tensor(rng.choice(values, size=(R, T)), dtype=torch.float64)
    else:
        rho = torch.rand(R, T, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    active = torch.tensor(rng.random(R) < 0.8) if seed % 4 == 1 else None
    widths = sorted({w for w in (1, 2, 4, 8, 16, 32, 64) if w < T} | {T})
    slope = float(rng.choice([0.0, 0.05, 0.5, 3.0]))
    t_ver = torch.tensor([1.0 + slope * i for i in range(len(widths))], dtype=torch.float64)
    return (dense, rho.to(DEV), None if active is None else active.to(DEV),
            torch.tensor(widths, device=DEV), t_ver.to(DEV), rng)


def _rates(rank, rows, widths, t_ver, acceptance, overhead):
    """The torch curve's expected tokens per ms at every width."""
    fill = RowFill.of(rank, rows, acceptance)
    return width_fill_curve(rank, rows, widths, fill=fill) / (t_ver + overhead)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("root_floor", [0, 1, 3])
def test_the_kernel_chooses_as_the_torch_code(seed, root_floor):
    _chooses_as_the_torch_code(seed, root_floor, None)


@pytest.mark.parametrize("seed,T", [(20, 64), (21, 128), (22, 100)])
def test_the_kernel_chooses_as_the_torch_code_on_large_trees(seed, T):
    """Trees of 64 to 128 node slots: row blocks of 128 and widths up to the tree."""
    _chooses_as_the_torch_code(seed, 1, T)


def _chooses_as_the_torch_code(seed: int, root_floor: int, T: int | None) -> None:
    dense, rho, active, widths, t_ver, rng = _case(seed, T)
    rank = rank_dense(rho, dense, root_floor, active)
    R, T = rho.shape
    calib = AcceptanceCalibrator.log_bins(device=DEV)
    calib.table = torch.rand(calib.table.shape, dtype=torch.float64,
                             generator=torch.Generator().manual_seed(seed)).sort().values.to(DEV)
    for acceptance in (None, calib):
        for overhead in (0.0, 0.7, torch.tensor(2.5, dtype=torch.float64, device=DEV)):
            for max_width in (None, int(widths[0]), int(widths[len(widths) // 2])):
                want = width_fill_choice(rank, R, widths, t_ver, max_width=max_width,
                                         acceptance=acceptance, round_overhead_ms=overhead)
                got = width_fill_choice_triton(rank, R, widths, t_ver,
                                               _estimates(rank, acceptance),
                                               max_width=max_width, round_overhead_ms=overhead)
                if int(got.width) != int(want.width):
                    # only a last-bit tie of rates, summed in another order, may part them
                    rate = _rates(rank, R, widths, t_ver, acceptance, overhead)
                    mine = rate[(widths == got.width).nonzero()[0, 0]]
                    assert torch.isclose(mine, rate.max(), rtol=1e-12, atol=0.0)
                    continue
                assert torch.equal(got.keep, want.keep)
                assert torch.equal(got.kept, want.kept)
                assert bool(got.could_widen) == bool(want.could_widen)


def test_ties_go_to_the_narrower_width():
    """Equal rates at every width (a flat curve and nothing eligible): both take the first."""
    trees = [DraftTree.random(1, 1, np.random.default_rng(0)) for _ in range(2)]
    dense = DenseForest.from_packed(PackedForest.pack(trees), 4, device=DEV)
    rho = torch.ones(2, 4, dtype=torch.float64, device=DEV)
    rank = rank_dense(rho, dense, 1, None)
    widths = torch.tensor([2, 4], device=DEV)
    t_ver = torch.ones(2, dtype=torch.float64, device=DEV)
    got = width_fill_choice_triton(rank, 2, widths, t_ver, _estimates(rank, None))
    want_width, _ = goodput_best(widths, width_fill_curve(rank, 2, widths), t_ver)
    assert int(got.width) == int(want_width) == 2
    assert got.keep.sum().item() == 2 and not bool(got.could_widen)


def test_bad_inputs_are_clear_errors():
    dense, rho, _, widths, t_ver, _ = _case(0)
    rank = rank_dense(rho, dense, 1, None)
    R = rho.shape[0]
    est = _estimates(rank, None)
    with pytest.raises(ValueError, match="do not split into"):
        width_fill_choice_triton(rank, R + 7, widths, t_ver, est)
    with pytest.raises(ValueError, match="must be the same non-empty"):
        width_fill_choice_triton(rank, R, widths, t_ver[:-1], est)
    with pytest.raises(ValueError, match="est"):
        width_fill_choice_triton(rank, R, widths, t_ver, est[:-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel path runs on CUDA only")
def test_width_fill_choice_takes_the_kernel_when_asked(monkeypatch):
    dense, rho, active, widths, t_ver, _ = _case(3)
    rank = rank_dense(rho, dense, 1, active)
    R = rho.shape[0]
    monkeypatch.setenv("BOLE_WIDTH_KERNEL", "0")
    want = width_fill_choice(rank, R, widths, t_ver, round_overhead_ms=0.5)
    monkeypatch.setenv("BOLE_WIDTH_KERNEL", "1")
    import bole.ops.width.kernel as wk
    calls = []
    real = wk.width_fill_choice_triton
    monkeypatch.setattr(wk, "width_fill_choice_triton",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    got = width_fill_choice(rank, R, widths, t_ver, round_overhead_ms=0.5)
    assert calls and int(got.width) == int(want.width)
    assert torch.equal(got.keep, want.keep) and torch.equal(got.kept, want.kept)
