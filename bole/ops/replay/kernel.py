"""The replay drafter's proposals in one Triton launch (the CUDA path of
:meth:`bole.speculative.drafters.replay.ReplayDrafter._propose`; its torch code is the reference).

    propose_triton(continuation [S + 1, L + 1], row [R], ctx [R], stream [S + 1], slots [R],
                   seed_key, frontier [R, K], table_tokens [R, C], table_depth [R, C], cum [k],
                   topk, vocab, max_len) -> tokens [R, K, topk] int64

One program per frontier node: its position, the target's token there and after it, whether it
is on the target's path, its hash key (the hash of seed, stream key, ctx and node id, computed
here rather than read from a table of the round's keys), the rank that holds the true token,
and its ``topk`` proposals. The torch code takes about thirty launches a step and about
seventy more for the round's keys: a cost of the stand-in, which a real head does not pay,
added to every mode's drafting time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bole.ops.triton_utils import check_kernel_device

__all__ = ["propose_triton"]


@triton.jit
def _fmix31(x):
    """:func:`bole.speculative.drafters.replay._fmix31` on int64 values in ``[0, 2**31)``."""
    x = x ^ (x >> 16)
    x = (x * 0x05EBCA6B) & 0x7FFFFFFF
    x = x ^ (x >> 13)
    x = (x * 0x42B2AE35) & 0x7FFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _combine(h, x):
    return _fmix31(h ^ _fmix31(x))


@triton.jit(do_not_specialize=["C", "n_cum", "vocab", "max_len", "seed_key"])
def _propose_kernel(continuation, row, ctx, stream, slots, seed_key, frontier, t_tok, t_dep, cum,
                    out, C, n_cum, vocab, max_len, K: tl.constexpr, TOPK: tl.constexpr,
                    TB: tl.constexpr, CB: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)                # frontier entry r * K + k
    r = i // K
    f = tl.maximum(tl.load(frontier + i), 0)
    depth = tl.load(t_dep + r * C + f)
    base_row = tl.load(row + r)
    position = tl.load(ctx + r) + depth
    here = tl.load(continuation + base_row + tl.minimum(position, max_len))
    nxt = tl.load(continuation + base_row + tl.minimum(position + 1, max_len))
    on_path = (depth == 0) | (tl.load(t_tok + r * C + f) == here)
    c_r = tl.load(ctx + r)
    seed = tl.full([], 0, tl.int64) + seed_key
    head = _combine(_combine(seed, tl.load(stream + tl.load(slots + r))), c_r & 0x7FFFFFFF)
    key = _combine(head, _fmix31(tl.where(on_path, depth, C + f).to(tl.int64)))
    # the rank holding the true token: how many cumulative acceptances the uniform reaches
    j = tl.arange(0, CB)
    c = tl.load(cum + j, mask=j < n_cum, other=2.0)
    u = key.to(tl.float64) * (1.0 / 2147483648.0)
    hit = tl.sum((u >= c).to(tl.int64), axis=0)
    known = nxt >= 0
    base = tl.where(known, nxt + 1 + key % (vocab - TOPK), key % vocab)
    rank = tl.arange(0, TB)
    tokens = (base + rank) % vocab
    tokens = tl.where(on_path & known & (rank == hit), nxt, tokens)
    tl.store(out + i * TOPK + rank, tokens, mask=rank < TOPK)


def propose_triton(continuation: torch.Tensor, row: torch.Tensor, ctx: torch.Tensor,
                   stream: torch.Tensor, slots: torch.Tensor, seed_key: int,
                   frontier: torch.Tensor, table_tokens: torch.Tensor,
                   table_depth: torch.Tensor, cum: torch.Tensor, topk: int, vocab: int,
                   max_len: int) -> torch.Tensor:
    """The replayed proposal tokens ``[R, K, topk]`` int64 of ``frontier [R, K]`` (see the
    module docstring and :meth:`ReplayDrafter._propose`, whose arguments these are)."""
    check_kernel_device(frontier.device, "the replay drafter's proposals")
    R, K = frontier.shape
    C = table_tokens.shape[1]
    if table_depth.shape != (R, C) or row.shape != (R,) or ctx.shape != (R,) \
            or slots.shape != (R,) or stream.dim() != 1:
        raise ValueError(f"propose_triton: table_depth {tuple(table_depth.shape)}, row "
                         f"{tuple(row.shape)}, ctx {tuple(ctx.shape)}, slots "
                         f"{tuple(slots.shape)} and stream {tuple(stream.shape)} must be "
                         f"[R, C], [R], [R], [R] and [S] for R={R}, C={C}")
    if not 0 <= int(seed_key) < 2 ** 31:
        raise ValueError(f"seed_key must lie in [0, 2**31), got {seed_key}")
    out = torch.empty(R, K, topk, dtype=torch.int64, device=frontier.device)
    if R * K == 0:
        return out
    _propose_kernel[(R * K,)](
        continuation, row.to(torch.int64).contiguous(), ctx.to(torch.int64).contiguous(),
        stream.to(torch.int64).contiguous(), slots.to(torch.int64).contiguous(), int(seed_key),
        frontier.to(torch.int64).contiguous(), table_tokens.contiguous(),
        table_depth.contiguous(), cum.to(torch.float64).contiguous(), out, C, cum.numel(),
        vocab, max_len, K=K, TOPK=int(topk), TB=triton.next_power_of_2(int(topk)),
        CB=max(2, triton.next_power_of_2(cum.numel())), num_warps=1)
    return out
