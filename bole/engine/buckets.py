"""Batch buckets: the row counts a round (and an admission) pads its requests to, one set of
buffers and graphs each."""

from __future__ import annotations

__all__ = ["BUCKETS", "buckets_upto", "bucket_for"]

#: batch buckets: a round pads its rows to the next one
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def buckets_upto(max_slots: int) -> list[int]:
    """The row counts rounds of an engine of ``max_slots`` slots pad to, ascending: the
    buckets below it, then ``max_slots`` itself (51 slots pay for 51 rows, not 64)."""
    return [b for b in BUCKETS if b < max_slots] + [max_slots]


def bucket_for(n: int, max_slots: int) -> int | None:
    """The rows a round of ``n`` requests pads to (the smallest of :func:`buckets_upto` >= n),
    or None when n exceeds ``max_slots``."""
    return next((b for b in buckets_upto(max_slots) if b >= n), None)
