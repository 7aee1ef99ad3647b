"""Goodput's width choice in two Triton launches: the CUDA path of
:func:`bole.speculative.budget.expected.width_fill_choice`, whose torch code is the reference
(``BOLE_WIDTH_KERNEL=0`` in the environment keeps the torch code on CUDA too).

    width_fill_choice_triton(order [N], eligible [N], root [N], floor [N], rows, widths [Wn],
                             t_ver [Wn], est [N], *, max_width, round_overhead_ms)
        -> (width, keep [rows, T], kept [rows], could_widen)

1. One program per block of rank places writes each node's place in the rank order (the
   inverse of ``order``).
2. One program for the batch walks its rows twice. First pass: each eligible node's position
   among its row's eligible nodes in rank order (the count of those before it), and at every
   width the estimates of the row's first ``min(W - 1 - floors, eligible)`` of them, summed into
   the expected-tokens curve with the roots and the floors' estimates. The width of the most
   expected tokens per ms (the first on ties) is the choice. Second pass: each row's fill at
   the choice bounds what lies past it (:func:`~bole.speculative.budget.expected.width_fill_could_widen`),
   and each row keeps its roots, floors and best eligible nodes up to ``min(choice, max_width)``
   slots.

The torch path is about 60 small launches (a sort, cumulative sums, gathers and scatters); the
second program is O(R T^2) comparisons, a few microseconds at the engine's sizes (T <= 64).
Sums of float64 estimates run in another order than torch's, so a curve may differ from the
reference in its last bits, and a width whose rate ties another's to the last bit may be
chosen differently.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bole.ops.triton_utils import check_kernel_device

__all__ = ["width_fill_choice_triton"]


@triton.jit(do_not_specialize=["N"])
def _place_kernel(order, place, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    node = tl.load(order + i, mask=m, other=0)
    tl.store(place + node, i.to(tl.int64), mask=m)


@triton.jit
def _row(place, eligible, root, floor, est, r, T, t, tm):
    """One row's nodes: eligible, floor and root flags, estimates, and each eligible node's
    1-based position among the row's eligible nodes in rank order (0 for the others)."""
    base = r * T
    p = tl.load(place + base + t, mask=tm, other=0)
    el = (tl.load(eligible + p, mask=tm, other=0) != 0) & tm
    fl = (tl.load(floor + base + t, mask=tm, other=0) != 0) & tm
    rt = (tl.load(root + base + t, mask=tm, other=0) != 0) & tm
    e = tl.load(est + base + t, mask=tm, other=0.0).to(tl.float64)
    ahead = el[None, :] & (p[None, :] < p[:, None])
    pos = tl.where(el, tl.sum(ahead.to(tl.int32), axis=1) + 1, 0)
    return el, fl, rt, e, pos


@triton.jit(do_not_specialize=["R", "T", "Wn", "max_width"])
def _choice_kernel(place, eligible, root, floor, est, widths, t_ver, overhead, width_out,
                   keep_out, kept_out, widen_out, R, T, Wn, max_width, TB: tl.constexpr,
                   WB: tl.constexpr):
    t = tl.arange(0, TB)
    tm = t < T
    wi = tl.arange(0, WB)
    wm = wi < Wn
    W = tl.load(widths + wi, mask=wm, other=0).to(tl.int32)
    t_all = tl.load(t_ver + wi, mask=wm, other=1.0).to(tl.float64) + \
        tl.load(overhead + wi * 0).to(tl.float64)
    curve = tl.zeros([WB], dtype=tl.float64)
    for r in range(R):
        el, fl, rt, e, pos = _row(place, eligible, root, floor, est, r, T, t, tm)
        n_floor = tl.sum(fl.to(tl.int32), axis=0)
        n_el = tl.sum(el.to(tl.int32), axis=0)
        take = tl.minimum(tl.maximum(W - 1 - n_floor, 0), n_el)                     # [WB]
        inc = el[None, :] & (pos[None, :] <= take[:, None])
        fixed = tl.sum(rt.to(tl.float64), axis=0) + tl.sum(tl.where(fl, e, 0.0), axis=0)
        curve += tl.sum(tl.where(inc, e[None, :], 0.0), axis=1) + fixed
    rate = tl.where(wm, curve / t_all, float("-inf"))
    best_rate = tl.max(rate, axis=0)
    best = tl.min(tl.where(rate == best_rate, wi, WB), axis=0)       # the first maximum
    at = wi == best
    choice = tl.sum(tl.where(at, W, 0), axis=0)
    at_expected = tl.sum(tl.where(at, curve, 0.0), axis=0)
    at_t = tl.sum(tl.where(at, t_all, 0.0), axis=0)
    fill_to = tl.minimum(choice, max_width)
    more = tl.zeros([WB], dtype=tl.float64)
    for r in range(R):
        el, fl, rt, e, pos = _row(place, eligible, root, floor, est, r, T, t, tm)
        n_floor = tl.sum(fl.to(tl.int32), axis=0)
        n_el = tl.sum(el.to(tl.int32), axis=0)
        kept = tl.minimum(tl.maximum(choice - 1 - n_floor, 0), n_el)
        last = tl.max(tl.where(el & (pos == kept) & (kept > 0), e, 0.0), axis=0)
        floor_top = tl.max(tl.where(fl, e, 0.0), axis=0)
        bound = tl.where(kept > 0, last, tl.where(n_floor > 0, floor_top, 1.0))
        take = tl.minimum(tl.maximum(W - 1 - n_floor, 0), n_el)
        more += tl.maximum(take - kept, 0).to(tl.float64) * bound
        fill = tl.minimum(tl.maximum(fill_to - 1 - n_floor, 0), n_el)
        keep = rt | fl | (el & (pos <= fill))
        tl.store(keep_out + r * T + t, keep.to(tl.int8), mask=tm)
        tl.store(kept_out + r, (tl.sum(rt.to(tl.int32), axis=0) + n_floor + kept).to(tl.int64))
    better = ((at_expected + more) / t_all > at_expected / at_t) & (W > choice) & wm
    tl.store(width_out, choice.to(tl.int64))
    tl.store(widen_out, (tl.max(better.to(tl.int32), axis=0) > 0).to(tl.int8))


def _as_int8(flags: torch.Tensor) -> torch.Tensor:
    """A bool tensor's bytes, for the kernel's loads."""
    return flags.contiguous().view(torch.int8)


def width_fill_choice_triton(order: torch.Tensor, eligible: torch.Tensor, root: torch.Tensor,
                             floor: torch.Tensor, rows: int, widths: torch.Tensor,
                             t_ver: torch.Tensor, est: torch.Tensor, *,
                             max_width: int | None = None,
                             round_overhead_ms: float | torch.Tensor = 0.0,
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fields of :func:`bole.speculative.budget.expected.width_fill_choice` from a ranking of the
    ``rows x T`` dense layout (``order``, ``eligible`` in rank order, ``root`` and ``floor`` per
    node, all ``[N]``) and its nodes' acceptance estimates ``est [N]`` (float64, as
    ``_estimates`` gives them), in two launches. No synchronisation. Returns
    ``(width 0-d int64, keep [rows, T] bool, kept [rows] int64, could_widen 0-d bool)``."""
    N = order.shape[0]
    if rows < 1 or N % rows:
        raise ValueError(f"{N} ranked nodes do not split into {rows} rows")
    if widths.dim() != 1 or t_ver.shape != widths.shape or widths.numel() < 1:
        raise ValueError(f"widths {tuple(widths.shape)} and t_ver {tuple(t_ver.shape)} must be "
                         f"the same non-empty [Wn]")
    if est.shape != (N,):
        raise ValueError(f"est {tuple(est.shape)} must be [N] = [{N}]")
    dev = order.device
    check_kernel_device(dev, "width_fill_choice_triton")
    T = N // rows
    overhead = torch.as_tensor(round_overhead_ms, dtype=torch.float64, device=dev).reshape(1)
    width = torch.empty((), dtype=torch.int64, device=dev)
    keep = torch.empty(rows, T, dtype=torch.int8, device=dev)
    kept = torch.empty(rows, dtype=torch.int64, device=dev)
    widen = torch.empty((), dtype=torch.int8, device=dev)
    place = torch.empty(N, dtype=torch.int64, device=dev)
    block = 256
    _place_kernel[(triton.cdiv(N, block),)](order.contiguous(), place, N, BLOCK=block,
                                           num_warps=4)
    cap = T if max_width is None else int(max_width)
    _choice_kernel[(1,)](place, _as_int8(eligible), _as_int8(root), _as_int8(floor),
                         est.to(torch.float64).contiguous(), widths.contiguous(),
                         t_ver.to(torch.float64).contiguous(), overhead, width, keep, kept,
                         widen, rows, T, widths.numel(), cap, TB=triton.next_power_of_2(T),
                         WB=triton.next_power_of_2(widths.numel()), num_warps=4)
    return width, keep.view(torch.bool), kept, widen.view(torch.bool)
