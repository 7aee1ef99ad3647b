"""Lossless acceptance of a dense draft forest on the device, without host synchronisation.

This is the rule of :func:`bole.speculative.accept.accept_forest` in fixed shapes, so that a whole
speculative round (forward, target distribution, acceptance) can be captured in one CUDA graph:

* greedy requests follow the child whose token is the argmax of its parent's logits (the first such
  child in draft order) and emit the argmax at the deepest accepted node;
* sampled requests walk from the root; at node u with residual distribution p the children are tried
  in draft (index) order, child x is accepted iff ``uniform < p(x) / sum(p)``, a rejected x is
  removed from p (``p(x) = 0``) before the next sibling, and when every child fails (or u is a leaf)
  the bonus token is drawn from the residual by inverse CDF.

Randomness comes in as a tensor of uniforms drawn beforehand (:func:`draw_uniforms`), one per
sibling trial per tree level plus one per level for the bonus draw, so the functions are
deterministic given them. Loops run over static bounds only (the forest's depth bound and the
number of sibling ranks).

Layout: request r owns node slots ``r * T .. r * T + T - 1`` (:class:`bole.forest.DenseForest`);
per-request results are ``[R]`` tensors, paths ``[R, max_depth + 1]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from bole.forest import DenseForest
from bole.sampling_params import SamplingParams

__all__ = ["SamplingBatch", "DeviceAcceptance", "EMITTED_PAD", "target_probs_rows", "sample_rows",
           "sample_tokens", "draw_uniforms", "children_slots", "accept_greedy", "accept_sampled",
           "accept"]

EMITTED_PAD = -1
"""Filler of ``DeviceAcceptance.emitted`` past ``num_emitted``."""


# ---------------------------------------------------------------- per-request sampling parameters

@dataclass
class SamplingBatch:
    """Per-request sampling parameters as device tensors, plus host flags to skip work with.

    temperature: ``[R]`` float32, 0 = greedy.   top_k: ``[R]`` int64, 0 = off.
    top_p: ``[R]`` float32, 1 = off.
    presence, frequency, repetition: ``[R]`` float32 penalties (0, 0, 1 = off).
    inv_temperature: ``[R]`` float32 rounding of the double ``1 / temperature`` (1 for greedy
    requests): what CUDA multiplies by when ``target_probs`` divides by a Python float.
    The flags and ``max_top_k`` only look at sampled (non-greedy) requests: a greedy request's
    filters never matter. ``any_penalty`` looks at every request (penalties change greedy
    requests' argmax too).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    inv_temperature: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    max_top_k: int
    any_penalty: bool = False

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device=None) -> "SamplingBatch":
        """Validate ``params`` (one per request) and move them to ``device``."""
        if len(params) == 0:
            raise ValueError("a SamplingBatch needs at least one request")
        for p in params:
            p.validate()
        sampled = [p for p in params if not p.greedy]
        # the reciprocal in double precision, then rounded once to float32
        inverse = [1.0 / p.temperature if p.temperature > 0 else 1.0 for p in params]
        f32 = lambda name: torch.tensor([float(getattr(p, name)) for p in params],  # noqa: E731
                                        dtype=torch.float32, device=device)
        return cls(
            temperature=torch.tensor([float(p.temperature) for p in params], dtype=torch.float32,
                                     device=device),
            top_k=torch.tensor([int(p.top_k) for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([float(p.top_p) for p in params], dtype=torch.float32,
                               device=device),
            inv_temperature=torch.tensor(inverse, dtype=torch.float32, device=device),
            presence=f32("presence_penalty"), frequency=f32("frequency_penalty"),
            repetition=f32("repetition_penalty"),
            all_greedy=not sampled,
            any_greedy=len(sampled) < len(params),
            any_top_k=any(p.top_k > 0 for p in sampled),
            any_top_p=any(p.top_p < 1 for p in sampled),
            max_top_k=max([p.top_k for p in sampled], default=0),
            any_penalty=any(p.penalized for p in params),
        )

    @property
    def num_requests(self) -> int:
        return self.temperature.shape[0]

    @property
    def greedy(self) -> torch.Tensor:
        """``[R]`` bool, True for greedy requests."""
        return self.temperature == 0


# ---------------------------------------------------------------- the target distribution

def _divide_by_temperature(x: torch.Tensor, temperature: torch.Tensor,
                           inv_temperature: torch.Tensor) -> torch.Tensor:
    """``x [N, V] / temperature [N]`` rounded exactly as ``x / python_float`` on x's device.

    CUDA divides by a host scalar as a multiplication by its reciprocal (computed on the host in
    double, rounded to float32; checked on PyTorch 2.11 / H200), the CPU as a true division; both
    are reproduced with device-resident per-row values.
    """
    if x.is_cuda:
        return x * inv_temperature[:, None]
    return x / temperature[:, None]


def _top_k_filter(x: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Mask (to -inf) every logit below the row's k-th largest one, for rows with ``0 < k < V``.

    ``max_top_k`` (host int) bounds k over filtered rows, so one ``topk`` of that width serves all
    rows; the k-th largest value is the same element whatever the tie order."""
    V = x.shape[-1]
    width = max(1, min(max_top_k, V))
    top = torch.topk(x, width, dim=-1).values                                   # [N, width]
    kth = torch.gather(top, 1, (top_k.clamp(1, width) - 1)[:, None])            # [N, 1]
    active = (top_k > 0) & (top_k < V)
    return x.masked_fill(active[:, None] & (x < kth), float("-inf"))


def _top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p`` (the crossing token
    included) and renormalise, for rows with ``top_p < 1``; other rows are returned unchanged."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p          # mass strictly before each token
    active = (top_p < 1)[:, None]
    drop_sorted = (before >= top_p[:, None]) & active
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    kept = probs.masked_fill(drop, 0.0)
    return torch.where(active, kept / kept.sum(-1, keepdim=True), probs)


def target_probs_rows(logits: torch.Tensor, batch: SamplingBatch,
                      nodes_per_request: int | None = None) -> torch.Tensor:
    """fp32 target probabilities of every row under its request's temperature, top-k and top-p.

    logits: ``[R, T, V]`` or ``[N, V]`` with ``N = R * nodes_per_request`` (row n belongs to request
    ``n // nodes_per_request``; inferred from N and R when omitted). Returns the input's shape.
    Each sampled row holds the same numbers as :func:`bole.speculative.sampling.target_probs`
    applied, with its request's parameters, to the same-shaped logits (same kernels, same reduction
    orders). On the CPU reductions ignore the number of rows, so that is also target_probs of the
    row alone; on CUDA target_probs itself can differ by an ulp between a slice and the whole batch
    (the reduction split follows the shape). Greedy rows hold a valid but meaningless distribution
    (greedy acceptance uses the argmax, never these rows).
    """
    shape = logits.shape
    R = batch.num_requests
    if logits.dim() == 3:
        if shape[0] != R or (nodes_per_request not in (None, shape[1])):
            raise ValueError(f"logits {tuple(shape)} do not match {R} requests x "
                             f"{nodes_per_request} nodes")
        T = shape[1]
    elif logits.dim() == 2:
        T = nodes_per_request if nodes_per_request is not None else shape[0] // R
        if T * R != shape[0]:
            raise ValueError(f"{shape[0]} rows are not {R} requests x {T} nodes")
    else:
        raise ValueError(f"logits must be [R, T, V] or [N, V], got {tuple(shape)}")
    x = logits.reshape(-1, shape[-1]).float()
    per_row = lambda t: t[:, None].expand(R, T).reshape(-1)  # noqa: E731  (request -> its rows)
    temperature = per_row(torch.where(batch.temperature > 0, batch.temperature, 1.0))
    x = _divide_by_temperature(x, temperature, per_row(batch.inv_temperature))
    if batch.any_top_k:
        x = _top_k_filter(x, per_row(batch.top_k), batch.max_top_k)
    probs = torch.softmax(x, dim=-1)
    if batch.any_top_p:
        probs = _top_p_filter(probs, per_row(batch.top_p))
    return probs.reshape(shape)


# ---------------------------------------------------------------- inverse-CDF sampling

def sample_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw one token per row of ``probs [N, V]`` (unnormalised, >= 0) with ``u [N]`` in [0, 1).

    Inverse CDF: the first token with positive probability whose cumulative mass exceeds
    ``u * total``. A zero-probability token is never returned, even where rounding makes the
    cumulative sum non-monotone or ``u * total`` reaches the total (then the last positive token is
    returned). A row without any positive entry returns 0. Returns ``[N]`` int64.
    """
    V = probs.shape[-1]
    cdf = torch.cumsum(probs, dim=-1)
    target = u.to(cdf.dtype)[:, None] * cdf[:, -1:]
    positive = probs > 0
    hit = positive & (cdf > target)
    idx = torch.arange(V, device=probs.device, dtype=torch.int64)
    # hits rank above every non-hit, the lowest index first; then the highest positive non-hit
    key = torch.where(hit, 2 * V - idx, torch.where(positive, idx, -1))
    return key.argmax(dim=-1)


def sample_tokens(logits: torch.Tensor, batch: SamplingBatch, u: torch.Tensor) -> torch.Tensor:
    """Plain decoding: ``logits [R, V]`` -> ``[R]`` int64 tokens (greedy rows take the first
    argmax, sampled rows :func:`sample_rows` of their target distribution with ``u [R]``)."""
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy
    drawn = sample_rows(target_probs_rows(logits, batch, 1), u)
    return torch.where(batch.greedy, greedy, drawn) if batch.any_greedy else drawn


def draw_uniforms(num_requests: int, max_depth: int, max_children: int,
                  generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """``[R, max_depth + 1, max_children + 1]`` float32 uniforms in [0, 1) for
    :func:`accept_sampled`: ``[r, d, j]`` decides the trial of the j-th child at depth d,
    ``[r, d, max_children]`` draws the bonus token when the walk stops at depth d."""
    return torch.rand((num_requests, max_depth + 1, max_children + 1), generator=generator,
                      device=device, dtype=torch.float32)


# ---------------------------------------------------------------- results

@dataclass
class DeviceAcceptance:
    """Per-request outcome of a round, all device tensors.

    accepted:    ``[R]`` int64 local index of the deepest accepted node (0 = only the root).
    path:        ``[R, max_depth + 1]`` local nodes root first; past ``path_len`` the row repeats
                 the accepted node (:meth:`bole.forest.DenseForest.paths`).
    path_len:    ``[R]`` int64, depth(accepted) + 1.
    bonus:       ``[R]`` int64 token emitted after the accepted node.
    emitted:     ``[R, max_depth + 1]`` int64: the accepted path's tokens below the root, then the
                 bonus token, then :data:`EMITTED_PAD` (-1).
    num_emitted: ``[R]`` int64 = path_len (accepted drafted tokens + 1).
    """

    accepted: torch.Tensor
    path: torch.Tensor
    path_len: torch.Tensor
    bonus: torch.Tensor
    emitted: torch.Tensor
    num_emitted: torch.Tensor


def _finish(forest: DenseForest, tokens: torch.Tensor, accepted: torch.Tensor,
            bonus: torch.Tensor) -> DeviceAcceptance:
    """Paths and emitted tokens of ``accepted [R]`` nodes with their ``bonus [R]`` tokens."""
    path, length = forest.paths(accepted)
    D = path.shape[1]
    path_tokens = torch.gather(tokens, 1, path)                                  # [R, D]
    below_root = torch.cat([path_tokens[:, 1:], path_tokens[:, :1]], dim=1)     # shift left by one
    col = torch.arange(D, device=path.device)[None, :]
    last = (length - 1)[:, None]
    emitted = torch.where(col < last, below_root,
                          torch.where(col == last, bonus[:, None], EMITTED_PAD))
    return DeviceAcceptance(accepted, path, length, bonus, emitted, length)


def _check(tokens: torch.Tensor, forest: DenseForest) -> torch.Tensor:
    """``tokens`` as ``[R, T]`` int64, after checking it matches the forest."""
    R, T = forest.parents.shape
    if tokens.numel() != R * T:
        raise ValueError(f"tokens {tuple(tokens.shape)} do not match a forest of {R} x {T} slots")
    return tokens.reshape(R, T).to(torch.int64)


# ---------------------------------------------------------------- tree structure

def _earlier_siblings(forest: DenseForest) -> torch.Tensor:
    """``[R, T, T]`` bool: ``[r, i, j]`` iff j is a sibling of i with a lower index."""
    parents = forest.parents
    T = parents.shape[1]
    idx = torch.arange(T, device=parents.device)
    same = (parents[:, :, None] == parents[:, None, :]) & (parents[:, None, :] >= 0)
    return same & (idx[None, None, :] < idx[None, :, None])


def children_slots(forest: DenseForest, max_children: int) -> torch.Tensor:
    """``[R, T, max_children]`` int64 local indices of each node's first ``max_children`` children
    in draft (index) order, -1 past the last child. Children of higher rank are left out."""
    R, T = forest.parents.shape
    K = max_children
    dev = forest.parents.device
    rank = _earlier_siblings(forest).sum(-1)                                     # [R, T]
    keep = (forest.parents >= 0) & (rank < K)
    idx = torch.arange(T, device=dev)
    # kept children go to (parent, rank); every other node to its own dump column
    slot = torch.where(keep, forest.parents * K + rank, T * K + idx)
    table = torch.full((R, T * K + T), -1, dtype=torch.int64, device=dev)
    table.scatter_(1, slot, idx.expand(R, T).contiguous())
    return table[:, :T * K].reshape(R, T, K)


# ---------------------------------------------------------------- greedy

def _greedy_walk(argmax: torch.Tensor, tokens: torch.Tensor,
                 forest: DenseForest) -> tuple[torch.Tensor, torch.Tensor]:
    """``(accepted [R], bonus [R])`` of greedy acceptance, vectorised through the ancestor sets."""
    T = forest.parents.shape[1]
    dev = argmax.device
    has_parent = forest.parents >= 0
    parent_argmax = torch.gather(argmax, 1, forest.parents.clamp(min=0))
    matches = forest.valid & has_parent & (tokens == parent_argmax)
    # the walk takes the first matching child in draft order; a later duplicate is never followed
    shadowed = (_earlier_siblings(forest) & matches[:, None, :]).any(-1)
    good = (matches & ~shadowed) | (forest.valid & ~has_parent)                   # roots pass
    ok = forest.valid & ~(forest.ancestors & ~good[:, None, :]).any(-1)
    idx = torch.arange(T, device=dev)
    # deepest accepted node; the lowest index among equally deep ones
    score = torch.where(ok, forest.depth * T + (T - 1 - idx), -1)
    accepted = score.argmax(-1)
    bonus = torch.gather(argmax, 1, accepted[:, None])[:, 0]
    return accepted, bonus


def accept_greedy(argmax: torch.Tensor, tokens: torch.Tensor,
                  forest: DenseForest) -> DeviceAcceptance:
    """Greedy acceptance: a node is accepted iff every non-root node on its path is the first child
    (in draft order) whose token equals its parent's argmax; emit the argmax at the deepest one.

    argmax: ``[R, T]`` int64 argmax of each node's logits; tokens: ``[R, T]`` node tokens (the
    root's is never tested). Considers every child (no ``max_children`` bound).
    """
    tokens = _check(tokens, forest)
    argmax = argmax.reshape(tokens.shape).to(torch.int64)
    return _finish(forest, tokens, *_greedy_walk(argmax, tokens, forest))


# ---------------------------------------------------------------- sampled

def _sampled_walk(probs: torch.Tensor, tokens: torch.Tensor, forest: DenseForest,
                  uniforms: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(accepted [R], bonus [R])`` of the lossless walk (see :func:`accept_sampled`)."""
    R, T = tokens.shape
    V = probs.shape[-1]
    dev = probs.device
    flat = probs.reshape(R * T, V)
    base = torch.arange(R, device=dev) * T
    table = children_slots(forest, K)                                            # [R, T, K]
    cur = torch.zeros(R, dtype=torch.int64, device=dev)
    live = torch.ones(R, dtype=torch.bool, device=dev)
    # level d moves every live request from its node at depth d to an accepted child, if any
    for d in range(forest.max_depth):
        p = flat.index_select(0, base + cur)                                     # [R, V] residual
        kids = torch.gather(table, 1, cur[:, None, None].expand(R, 1, K))[:, 0]  # [R, K]
        moved = torch.zeros_like(live)
        for j in range(K):
            child = kids[:, j]
            trying = live & ~moved & (child >= 0)
            x = torch.gather(tokens, 1, child.clamp(min=0)[:, None])             # [R, 1]
            px = torch.gather(p, 1, x)[:, 0]
            ratio = px / p.sum(-1).clamp_min(1e-30)
            ok = trying & (uniforms[:, d, j] < ratio)
            cur = torch.where(ok, child, cur)
            moved = moved | ok
            # a rejected token leaves the residual; other rows write their value back unchanged
            p.scatter_(1, x, torch.where(trying & ~ok, 0.0, px)[:, None])
        live = live & moved
    # the walk stopped at `cur` after every tried child failed: its residual is its distribution
    # without the children's tokens
    p = flat.index_select(0, base + cur)
    kids = torch.gather(table, 1, cur[:, None, None].expand(R, 1, K))[:, 0]
    for j in range(K):                     # one rank at a time: a row never writes a token twice
        x = torch.gather(tokens, 1, kids[:, j:j + 1].clamp(min=0))               # [R, 1]
        p.scatter_(1, x, torch.where(kids[:, j:j + 1] >= 0, 0.0, torch.gather(p, 1, x)))
    depth = torch.gather(forest.depth, 1, cur[:, None])                          # [R, 1]
    u = torch.gather(uniforms[:, :, K], 1, depth)[:, 0]
    return cur, sample_rows(p, u)


def _num_children(forest: DenseForest, uniforms: torch.Tensor, max_children: int | None) -> int:
    """The sibling-rank bound K, checked against ``uniforms [R, max_depth + 1, K + 1]``."""
    R, D = forest.num_requests, forest.max_depth + 1
    if uniforms.dim() != 3 or uniforms.shape[:2] != (R, D):
        raise ValueError(f"uniforms {tuple(uniforms.shape)} must be [{R}, {D}, max_children + 1]")
    K = uniforms.shape[2] - 1
    if max_children is not None and max_children != K:
        raise ValueError(f"uniforms {tuple(uniforms.shape)} are drawn for {K} children per node, "
                         f"not max_children={max_children}")
    return K


def accept_sampled(probs: torch.Tensor, tokens: torch.Tensor, forest: DenseForest,
                   uniforms: torch.Tensor, max_children: int | None = None) -> DeviceAcceptance:
    """Lossless acceptance with pre-drawn uniforms (the rule of ``accept_forest``).

    From the root, at node u of depth d with residual p (u's target distribution), the j-th child x
    (draft order, j < max_children) is accepted iff ``uniforms[r, d, j] < p(x) / sum(p)``; on
    rejection ``p(x) = 0`` and the next child is tried. When all fail or u is a leaf, the bonus is
    :func:`sample_rows` of the residual with ``uniforms[r, d, max_children]``.

    probs: ``[R, T, V]`` (or ``[R * T, V]``) target distribution per node; tokens: ``[R, T]``;
    uniforms: ``[R, max_depth + 1, max_children + 1]`` (:func:`draw_uniforms`); ``max_children``
    defaults to what ``uniforms`` is drawn for. Children of rank >= max_children are never tried
    (still lossless, only fewer chances).
    """
    tokens = _check(tokens, forest)
    K = _num_children(forest, uniforms, max_children)
    accepted, bonus = _sampled_walk(probs, tokens, forest, uniforms.float(), K)
    return _finish(forest, tokens, accepted, bonus)


# ---------------------------------------------------------------- mixed batches

def accept(logits: torch.Tensor, tokens: torch.Tensor, forest: DenseForest, batch: SamplingBatch,
           uniforms: torch.Tensor | None = None, max_children: int | None = None,
           forced: torch.Tensor | None = None) -> DeviceAcceptance:
    """Accept a verified forest: greedy requests by :func:`accept_greedy` on the logits' argmax,
    sampled requests by :func:`accept_sampled` on :func:`target_probs_rows`, merged per request.

    logits: ``[R, T, V]`` or ``[R * T, V]`` (any float dtype); tokens: ``[R, T]``; uniforms as for
    :func:`accept_sampled`, required unless ``batch.all_greedy``. ``forced [R, T]``: a token
    that greedy rows take as the target's choice after each node instead of the argmax, where
    it is >= 0 (the replay drafter's known continuation in benchmarks: see
    ``SpecConfig.forced_acceptance``).
    """
    tokens = _check(tokens, forest)
    R, T = tokens.shape
    if batch.num_requests != R:
        raise ValueError(f"{batch.num_requests} sampling parameters for {R} requests")
    logits = logits.reshape(R, T, logits.shape[-1])
    if forced is not None and forced.shape != (R, T):
        raise ValueError(f"forced must be [R, T] = [{R}, {T}], got {tuple(forced.shape)}")
    argmax = None
    if batch.all_greedy and tokens.is_cuda:       # one launch (bole/ops/accept/kernel.py; a row holds
        # one tree rooted at slot 0, as every forest the engine builds does)
        from bole.ops.accept.kernel import greedy_accept_fused
        accepted, path, path_len, bonus, emitted = greedy_accept_fused(
            logits.argmax(-1), tokens, forest.parents, forest.valid, forest.max_depth, forced,
            EMITTED_PAD)
        return DeviceAcceptance(accepted, path, path_len, bonus, emitted, path_len)
    if batch.any_greedy or batch.all_greedy:
        argmax = logits.argmax(-1)
        if forced is not None:
            argmax = torch.where(forced >= 0, forced, argmax)
    if batch.all_greedy:
        return _finish(forest, tokens, *_greedy_walk(argmax, tokens, forest))
    if uniforms is None:
        raise ValueError("sampled requests need pre-drawn uniforms (draw_uniforms)")
    K = _num_children(forest, uniforms, max_children)
    probs = target_probs_rows(logits, batch)
    accepted, bonus = _sampled_walk(probs, tokens, forest, uniforms.float(), K)
    if batch.any_greedy:
        g_accepted, g_bonus = _greedy_walk(argmax, tokens, forest)
        greedy = batch.greedy
        accepted = torch.where(greedy, g_accepted, accepted)
        bonus = torch.where(greedy, g_bonus, bonus)
    return _finish(forest, tokens, accepted, bonus)
