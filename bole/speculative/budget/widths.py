"""Verify widths: the buckets a row of the dense layout is padded to, what a budget spreads to,
and what a profile's verify time is at a width (a budget of ``R (W - 1)`` nodes,
:func:`width_capacity`, is the most that width's verify can take)."""

from __future__ import annotations

from typing import Sequence

__all__ = ["width_buckets", "width_bucket", "spread_width", "width_capacity", "width_priced_t_ver"]

# ---- the dense layout of the engine (R rows x T node slots) ----
def width_buckets(T: int) -> tuple[int, ...]:
    """The verify widths of a round whose trees have ``T`` node slots: powers of two, and T."""
    out, w = [], 2
    while w < T:
        out.append(w)
        w *= 2
    return tuple(out) + (T,)


def width_bucket(need: int, T: int) -> int:
    """The narrowest verify width of :func:`width_buckets` that holds ``need`` nodes a row (the
    tree's ``T``, at most)."""
    return next((w for w in width_buckets(T) if w >= need), T)


def spread_width(rows: int, nodes: int, T: int) -> int:
    """The verify width that ``nodes`` draft nodes spread evenly over ``rows`` rows need: each
    row a root plus ``ceil(nodes / rows)``, in a bucket of :func:`width_buckets`."""
    return width_bucket(1 + -(-nodes // rows), T)


def width_capacity(rows: int, nodes: int, T: int) -> int:
    """The most draft nodes a verify of ``rows`` rows takes at the width that ``nodes`` draft
    nodes spread evenly over them need (:func:`spread_width`): ``rows (W - 1)``. A dense verify
    pads every row to its width, so it costs the same for any count up to this one."""
    if rows < 1 or nodes < 0:
        raise ValueError(f"rows must be >= 1 and nodes >= 0, got {rows} and {nodes}")
    if nodes == 0:
        return 0
    return rows * (spread_width(rows, nodes, T) - 1)


def width_priced_t_ver(rows: int, node_grid: Sequence[int], t_ver: Sequence[float],
                       width: int) -> float:
    """The verify time (ms) of ``rows`` rows at verify width ``width``, from a profile's curve
    ``t_ver`` over ``node_grid`` (ascending; N nodes spread evenly over ``rows`` rows, each row
    padded to its width bucket): the largest grid point whose even spread fits the width, at
    most ``rows * (width - 1)`` nodes (the first point when none does)."""
    fits = [t for n, t in zip(node_grid, t_ver) if n <= rows * (width - 1)]
    return float(fits[-1] if fits else t_ver[0])
