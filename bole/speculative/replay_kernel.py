"""The replay drafter's proposals in one Triton launch (the CUDA path of
:meth:`bole.speculative.replay.ReplayDrafter._propose`; its torch code is the reference).

    propose_triton(continuation [S + 1, L + 1], row [R], ctx [R], keys [R, 2 C], frontier [R, K],
                   table_tokens [R, C], table_depth [R, C], cum [k], topk, vocab, max_len)
        -> tokens [R, K, topk] int64

One program per frontier node: its position, the target's token there and after it, whether it
is on the target's path, its hash key, the rank that holds the true token, and its ``topk``
proposals. The torch code takes about thirty launches a step: a cost of the stand-in, which a
real head does not pay, added to every mode's drafting time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bole.ops.triton_utils import check_kernel_device

__all__ = ["propose_triton"]


@triton.jit(do_not_specialize=["C", "n_cum", "vocab", "max_len"])
def _propose_kernel(continuation, row, ctx, keys, frontier, t_tok, t_dep, cum, out, C, n_cum,
                    vocab, max_len, K: tl.constexpr, TOPK: tl.constexpr, TB: tl.constexpr,
                    CB: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)                # frontier entry r * K + k
    r = i // K
    f = tl.maximum(tl.load(frontier + i), 0)
    depth = tl.load(t_dep + r * C + f)
    base_row = tl.load(row + r)
    position = tl.load(ctx + r) + depth
    here = tl.load(continuation + base_row + tl.minimum(position, max_len))
    nxt = tl.load(continuation + base_row + tl.minimum(position + 1, max_len))
    on_path = (depth == 0) | (tl.load(t_tok + r * C + f) == here)
    key = tl.load(keys + r * 2 * C + tl.where(on_path, depth, C + f))
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
                   keys: torch.Tensor, frontier: torch.Tensor, table_tokens: torch.Tensor,
                   table_depth: torch.Tensor, cum: torch.Tensor, topk: int, vocab: int,
                   max_len: int) -> torch.Tensor:
    """The replayed proposal tokens ``[R, K, topk]`` int64 of ``frontier [R, K]`` (see the
    module docstring and :meth:`ReplayDrafter._propose`, whose arguments these are)."""
    check_kernel_device(frontier.device, "the replay drafter's proposals")
    R, K = frontier.shape
    C = table_tokens.shape[1]
    if keys.shape != (R, 2 * C) or table_depth.shape != (R, C) or row.shape != (R,) \
            or ctx.shape != (R,):
        raise ValueError(f"propose_triton: keys {tuple(keys.shape)}, table_depth "
                         f"{tuple(table_depth.shape)}, row {tuple(row.shape)} and ctx "
                         f"{tuple(ctx.shape)} must be [R, 2C], [R, C], [R], [R] for "
                         f"R={R}, C={C}")
    out = torch.empty(R, K, topk, dtype=torch.int64, device=frontier.device)
    if R * K == 0:
        return out
    _propose_kernel[(R * K,)](
        continuation, row.to(torch.int64).contiguous(), ctx.to(torch.int64).contiguous(),
        keys.contiguous(), frontier.to(torch.int64).contiguous(), table_tokens.contiguous(),
        table_depth.contiguous(), cum.to(torch.float64).contiguous(), out, C, cum.numel(),
        vocab, max_len, K=K, TOPK=int(topk), TB=triton.next_power_of_2(int(topk)),
        CB=max(2, triton.next_power_of_2(cum.numel())), num_warps=1)
    return out
