"""Acceptance against rho, learnt online: :class:`AcceptanceCalibrator` maps a draft node's rho
to the acceptance observed per model and drafter (binned counts, made monotone by pool adjacent
violators), shared by the round runners of one model in a process (:func:`learnt_acceptance`)."""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Sequence

import torch
from torch import Tensor

__all__ = ["isotonic_fit", "isotonic_fit_device", "AcceptanceCalibrator", "learnt_acceptance",
           "saved_acceptance", "restore_acceptance", "forget_acceptance"]

_INF = float("inf")


# ---- acceptance against rho ----
def isotonic_fit(y: Sequence[float], weights: Sequence[float] | None = None) -> list[float]:
    """Weighted least-squares non-decreasing fit of ``y`` in its order: pool adjacent violators.

    Blocks of pooled values are kept on a stack as (mean, weight, length); a new value that
    breaks monotonicity merges with the blocks before it until their means are in order."""
    w = [1.0] * len(y) if weights is None else [float(x) for x in weights]
    if len(w) != len(y) or any(x <= 0 for x in w):
        raise ValueError("weights must be positive, one per value")
    blocks: list[list[float]] = []
    for value, weight in zip(y, w):
        blocks.append([float(value), weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [mean for mean, _, n in blocks for _ in range(int(n))]


def isotonic_fit_device(y: Tensor, weights: Tensor) -> Tensor:
    """:func:`isotonic_fit` of ``y [K]`` with positive ``weights [K]`` as tensor code (no host
    synchronisation), by the min-max formula of isotonic regression:
    ``fit[i] = max_{j <= i} min_{k >= i} mean(y[j..k])``, the means weighted, over ``[K, K]``
    interval means from prefix sums (K is a handful of bins)."""
    K = y.shape[0]
    w = weights.to(torch.float64)
    zero = torch.zeros(1, dtype=torch.float64, device=y.device)
    sw = torch.cat([zero, torch.cumsum(w, 0)])
    swy = torch.cat([zero, torch.cumsum(w * y.to(torch.float64), 0)])
    idx = torch.arange(K, device=y.device)
    j, k = idx[:, None], idx[None, :]
    span = sw[1:][None, :] - sw[:-1][:, None]                     # weight of y[j..k]
    mean = (swy[1:][None, :] - swy[:-1][:, None]) / torch.where(k >= j, span, 1.0)
    mean = torch.where(k >= j, mean, _INF)                        # [j, k], k < j never taken
    suffix_min = torch.flip(torch.cummin(torch.flip(mean, [1]), 1).values, [1])  # min over k >= i
    return torch.where(j <= k, suffix_min, -_INF).amax(0)       # max over j <= i


@dataclasses.dataclass
class AcceptanceCalibrator:
    """rho -> the probability that a draft node is accepted, learnt online per model.

    edges:  ``[K + 1]`` float64 bin edges over rho, ascending (rho outside goes to the end bins).
    count:  ``[K]`` float64 draft nodes seen per bin.
    hits:   ``[K]`` float64 of them accepted.
    table:  ``[K]`` float64 the fitted acceptance per bin (the bin's mid rho until fitted).
    prior:  pseudo-observations per bin at the mid rho: the uncalibrated estimate acceptance =
            rho holds where little has been seen.

    :meth:`observe`, :meth:`fit` and :meth:`__call__` are device code without synchronisation
    that write only into these tensors, so a CUDA graph may replay them.
    """

    edges: Tensor
    count: Tensor
    hits: Tensor
    table: Tensor
    prior: float = 4.0

    def __post_init__(self) -> None:
        if not self.prior > 0:
            raise ValueError(f"prior must be > 0 (it keeps empty bins defined), got {self.prior}")
        if self.edges.dim() != 1 or self.count.shape != (self.edges.shape[0] - 1,):
            raise ValueError("edges must be [K + 1] and count, hits, table [K]")

    @classmethod
    def log_bins(cls, bins: int = 16, low: float = 1e-4, device=None,
                 prior: float = 4.0) -> "AcceptanceCalibrator":
        """``bins`` bins, the first ``[0, low)``, the rest log-spaced from ``low`` to 1."""
        inner = torch.logspace(math.log10(low), 0.0, bins, dtype=torch.float64, device=device)
        edges = torch.cat([torch.zeros(1, dtype=torch.float64, device=device), inner])
        zeros = torch.zeros(bins, dtype=torch.float64, device=device)
        return cls(edges, zeros.clone(), zeros.clone(), cls._mids(edges), prior)

    @staticmethod
    def _mids(edges: Tensor) -> Tensor:
        return 0.5 * (edges[1:] + edges[:-1])

    def bin_of(self, rho: Tensor) -> Tensor:
        """Bin index of every rho (clamped to the end bins)."""
        rho = rho.to(self.edges.dtype)
        return (torch.bucketize(rho, self.edges, right=True) - 1).clamp(0, self.count.shape[0] - 1)

    def observe(self, rho: Tensor, accepted: Tensor, mask: Tensor | None = None) -> None:
        """Count draft nodes of score ``rho`` and whether each was accepted (on the accepted
        path); ``mask`` leaves out roots and padding. Any matching shapes."""
        weight = torch.ones_like(rho, dtype=torch.float64) if mask is None else mask.double()
        index = self.bin_of(rho).reshape(-1)
        self.count.scatter_add_(0, index, weight.reshape(-1))
        self.hits.scatter_add_(0, index, (accepted.double() * weight).reshape(-1))

    def fit(self) -> Tensor:
        """Refit ``table`` in place from the counts: per-bin rates with the prior, made
        non-decreasing in rho, weighted by the observations (:func:`isotonic_fit_device`). Device
        code without synchronisation (a CUDA graph may replay it); returns the table."""
        mids = self._mids(self.edges)
        weight = self.count + self.prior
        rate = (self.hits + self.prior * mids) / weight
        self.table.copy_(isotonic_fit_device(rate, weight))
        return self.table

    def __call__(self, rho: Tensor) -> Tensor:
        """The fitted acceptance of every rho (same shape, float64)."""
        return self.table.gather(0, self.bin_of(rho).reshape(-1)).view(rho.shape)


#: every model's acceptance estimates per drafter, shared by its round runners in this process
_LEARNT: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def learnt_acceptance(model, drafter: tuple, device) -> AcceptanceCalibrator:
    """The acceptance estimates of ``model`` drafting with ``drafter`` (a key such as
    ``(drafter kind, acceptance profile, draft vocabulary)``) on ``device``: one
    :class:`AcceptanceCalibrator` per model and drafter in this process, so that an engine
    starts from what earlier engines of the same model learnt (acceptance per rho is a property
    of the model and its drafter, not of a batch or an engine). Runners that share it must not
    run rounds concurrently (they write the same counts)."""
    per_model = _LEARNT.setdefault(model, {})
    key = (tuple(drafter), str(torch.device(device)))
    if key not in per_model:
        per_model[key] = AcceptanceCalibrator.log_bins(device=device)
    return per_model[key]


def saved_acceptance(model) -> dict:
    """A copy of what engines of ``model`` learnt (:func:`learnt_acceptance`), per drafter, for
    :func:`restore_acceptance`."""
    return {key: _copy(cal) for key, cal in _LEARNT.get(model, {}).items()}


def restore_acceptance(model, saved: dict) -> None:
    """Make ``saved`` (:func:`saved_acceptance`) what the next engines of ``model`` start from
    (a copy: their rounds do not change ``saved``)."""
    _LEARNT[model] = {key: _copy(cal) for key, cal in saved.items()}


def _copy(cal: AcceptanceCalibrator) -> AcceptanceCalibrator:
    return dataclasses.replace(cal, edges=cal.edges.clone(), count=cal.count.clone(),
                               hits=cal.hits.clone(), table=cal.table.clone())


def forget_acceptance(model) -> None:
    """Drop what engines of ``model`` learnt (:func:`learnt_acceptance`): the next engine
    starts from the prior, as in a fresh process (benchmarks that compare runs use it so that
    a run does not depend on which ran before it)."""
    _LEARNT.pop(model, None)
