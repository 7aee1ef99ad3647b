"""The MTP head's inputs for an accepted path, in one launch (the CUDA path of
:meth:`bole.speculative.drafters.mtp.MTPDrafter.observe_accepted`).

    observe_inputs(tree_tokens [R, T], path [R, P], path_global [R, P], hidden [N, H],
                   last_hidden [S, H], slots [R], start [R], count [R], junk_row)
        -> ObserveInputs, and last_hidden updated in place

After a round commits ``count[r]`` nodes of each request's accepted ``path`` (local node indices,
root first; ``path_global`` the same as rows of the verify forward's final-norm ``hidden``), the
MTP head writes the pool rows of those positions: node p of the path is token
``tree_tokens[r, path[r, p]]`` at position ``start[r] + p``, whose MTP input is the target's
hidden state of the position before (the slot's remembered last hidden state for p = 0, else
``hidden[path_global[r, p - 1]]``) and whose pool row is ``position - 1`` (the junk row past
``count``). The slot then remembers ``hidden[path_global[r, count - 1]]`` (unchanged where
``count == 0``). :func:`observe_inputs_torch` is the reference: about fifteen gathers, wheres and
index writes, which a small model's acceptance graph pays every round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["ObserveInputs", "observe_inputs", "observe_inputs_torch"]


@dataclass
class ObserveInputs:
    tokens: torch.Tensor      # [R * P] int64
    prev: torch.Tensor        # [R * P, H] the MTP input hidden states
    positions: torch.Tensor   # [R * P] int64
    rows: torch.Tensor        # [R, P] int64 MTP pool rows


def observe_inputs_torch(tree_tokens, path, path_global, hidden, last_hidden, slots, start, count,
                         junk_row: int) -> ObserveInputs:
    R, P = path.shape
    H = hidden.shape[-1]
    slots_l = slots.long()
    tokens = torch.gather(tree_tokens, 1, path)
    on_path = hidden[path_global.reshape(-1)].view(R, P, H)
    prev = torch.cat([last_hidden[slots_l][:, None].to(hidden.dtype), on_path[:, :-1]], dim=1)
    j = torch.arange(P, device=path.device)
    positions = start[:, None] + j
    rows = torch.where(j[None] < count[:, None], positions - 1, junk_row)
    last = torch.gather(on_path, 1, (count - 1).clamp(min=0)[:, None, None].expand(R, 1, H))[:, 0]
    keep = (count > 0)[:, None]
    last_hidden[slots_l] = torch.where(keep, last.to(last_hidden.dtype), last_hidden[slots_l])
    return ObserveInputs(tokens.reshape(-1), prev.reshape(R * P, H), positions.reshape(-1), rows)


@triton.jit(do_not_specialize=["T", "P"])
def _observe_kernel(tree_tokens, path, path_global, hidden, last_hidden, slots, start, count,
                    o_tok, o_prev, o_pos, o_rows, T, H, junk_row, P,
                    PB: tl.constexpr, HB: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, PB)
    pm = p < P
    node = tl.load(path + r * P + p, mask=pm, other=0)
    # the row of the node before each one (p - 1; p = 0 reads the slot's remembered state)
    g_before = tl.load(path_global + r * P + p - 1, mask=pm & (p > 0), other=0).to(tl.int64)
    slot = tl.load(slots + r).to(tl.int64)
    s0 = tl.load(start + r)
    n = tl.load(count + r)
    pos = s0 + p
    tl.store(o_tok + r * P + p, tl.load(tree_tokens + r * T + node, mask=pm, other=0), mask=pm)
    tl.store(o_pos + r * P + p, pos, mask=pm)
    tl.store(o_rows + r * P + p, tl.where(p < n, pos - 1, junk_row), mask=pm)
    first = (p == 0)[:, None]
    for h0 in range(0, H, HB):
        h = h0 + tl.arange(0, HB)
        m = pm[:, None] & (h < H)[None, :]
        from_path = tl.load(hidden + g_before[:, None] * H + h[None, :], mask=m & ~first, other=0.0)
        from_slot = tl.load(last_hidden + slot * H + h[None, :] + p[:, None] * 0, mask=m & first,
                            other=0.0)
        val = tl.where(first, from_slot.to(from_path.dtype), from_path)
        tl.store(o_prev + (r * P + p)[:, None] * H + h[None, :], val, mask=m)
    tl.debug_barrier()                         # the remembered state read before it is replaced
    if n > 0:
        g_last = tl.load(path_global + r * P + n - 1).to(tl.int64)
        for h0 in range(0, H, HB):
            h = h0 + tl.arange(0, HB)
            v = tl.load(hidden + g_last * H + h, mask=h < H)
            tl.store(last_hidden + slot * H + h, v.to(last_hidden.dtype.element_ty), mask=h < H)


def observe_inputs(tree_tokens, path, path_global, hidden, last_hidden, slots, start, count,
                   junk_row: int, impl: str = "auto") -> ObserveInputs:
    """The accepted paths' MTP inputs (see the module docstring); updates ``last_hidden``.
    ``impl``: "torch", "triton" (CUDA, or CPU tensors under TRITON_INTERPRET=1) or "auto" (the
    kernel on CUDA)."""
    if impl == "torch" or (impl == "auto" and path.device.type != "cuda"):
        return observe_inputs_torch(tree_tokens, path, path_global, hidden, last_hidden, slots,
                                    start, count, junk_row)
    R, P = path.shape
    T, H = tree_tokens.shape[1], hidden.shape[-1]
    dev = path.device
    out = ObserveInputs(torch.empty(R * P, dtype=torch.int64, device=dev),
                        torch.empty(R * P, H, dtype=hidden.dtype, device=dev),
                        torch.empty(R * P, dtype=torch.int64, device=dev),
                        torch.empty(R, P, dtype=torch.int64, device=dev))
    if R:
        PB = triton.next_power_of_2(P)
        _observe_kernel[(R,)](
            tree_tokens.to(torch.int64).contiguous(), path.to(torch.int64).contiguous(),
            path_global.contiguous(), hidden.contiguous(), last_hidden, slots,
            start.to(torch.int64).contiguous(), count.to(torch.int64).contiguous(),
            out.tokens, out.prev, out.positions, out.rows, T, H, junk_row, P, PB=PB,
            HB=max(16, min(triton.next_power_of_2(H), 4096 // PB)), num_warps=4)
    return out
