"""Greedy acceptance of a dense forest in one Triton launch (the CUDA path of
:func:`bole.speculative.accept_device.accept` for all-greedy batches).

    greedy_accept_fused(argmax [R, T], tokens [R, T], parents [R, T], valid [R, T], max_depth,
                        forced [R, T] | None, pad)
        -> (accepted [R], path [R, D], path_len [R], bonus [R], emitted [R, D]), D = max_depth + 1

The torch reference (``_greedy_walk`` then ``_finish`` in ``accept_device.py``) marks every node
whose path follows the argmax through [R, T, T] ancestor masks, then gathers the path and the
emitted tokens: about 35 launches. Greedy acceptance is a walk: from the root (node 0) take the
first child in draft order whose token is the current node's argmax, until none is. One program
per request walks its tree ``max_depth`` levels deep and writes the path, its length, the bonus
token and the emitted row; the accepted set is a single chain, so this is the same result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["greedy_accept_fused"]


@triton.jit
def _greedy_accept_kernel(argmax, forced, tokens, parents, valid,
                          accepted, path, path_len, bonus, emitted, T,
                          D: tl.constexpr, TB: tl.constexpr, DB: tl.constexpr,
                          HAS_FORCED: tl.constexpr, PAD: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    base = r * T
    idx = tl.arange(0, TB).to(tl.int64)
    m = idx < T
    par = tl.load(parents + base + idx, mask=m, other=-1)
    tok = tl.load(tokens + base + idx, mask=m, other=-1)
    ok = tl.load(valid + base + idx, mask=m, other=0) != 0
    cols = tl.arange(0, DB).to(tl.int64)
    walk = tl.zeros([DB], dtype=tl.int64)                    # path, root first
    out = tl.full([DB], PAD, dtype=tl.int64)                 # emitted tokens
    cur = tl.zeros([], dtype=tl.int64)
    length = tl.full([], 1, dtype=tl.int64)
    alive = tl.full([], 1, dtype=tl.int1)
    for d in range(D - 1):
        choice = tl.load(argmax + base + cur)
        if HAS_FORCED:
            f = tl.load(forced + base + cur)
            choice = tl.where(f >= 0, f, choice)
        hit = ok & (par == cur) & (tok == choice)
        j = tl.min(tl.where(hit, idx, TB), axis=0)
        alive = alive & (j < TB)
        out = tl.where(alive & (cols == d), choice, out)
        cur = tl.where(alive, j, cur)
        walk = tl.where(alive & (cols == d + 1), j, walk)
        length += alive.to(tl.int64)
    last = tl.load(argmax + base + cur)
    if HAS_FORCED:
        f = tl.load(forced + base + cur)
        last = tl.where(f >= 0, f, last)
    walk = tl.where(cols >= length, cur, walk)
    out = tl.where(cols == length - 1, last, out)
    cm = cols < D
    tl.store(path + r * D + cols, walk, mask=cm)
    tl.store(emitted + r * D + cols, out, mask=cm)
    tl.store(accepted + r, cur)
    tl.store(path_len + r, length)
    tl.store(bonus + r, last)


def greedy_accept_fused(argmax: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                        valid: torch.Tensor, max_depth: int,
                        forced: torch.Tensor | None = None, pad: int = -1,
                        ) -> tuple[torch.Tensor, ...]:
    """Greedy acceptance of R trees of T node slots (root at slot 0, parents before children),
    ``argmax [R, T]`` the target's choice after each node, ``forced [R, T]`` overriding it where
    >= 0. Paths are ``[R, max_depth + 1]``, padded with the accepted node; emitted rows are the
    path's tokens below the root, the bonus token, then ``pad``. CUDA tensors, or the CPU
    interpreter."""
    R, T = tokens.shape
    D = int(max_depth) + 1
    dev = tokens.device
    i64 = dict(dtype=torch.int64, device=dev)
    accepted, path_len, bonus = (torch.empty(R, **i64) for _ in range(3))
    path, emitted = torch.empty(R, D, **i64), torch.empty(R, D, **i64)
    if R:
        argmax = argmax.reshape(R, T).to(torch.int64).contiguous()
        f = argmax if forced is None else forced.reshape(R, T).to(torch.int64).contiguous()
        _greedy_accept_kernel[(R,)](
            argmax, f, tokens.to(torch.int64).contiguous(), parents.contiguous(),
            valid.contiguous().view(torch.uint8), accepted, path, path_len, bonus, emitted, T,
            D=D, TB=triton.next_power_of_2(T), DB=triton.next_power_of_2(D),
            HAS_FORCED=forced is not None, PAD=pad, num_warps=1)
    return accepted, path, path_len, bonus, emitted
