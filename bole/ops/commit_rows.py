"""The commit's row moves (what :meth:`bole.engine.runner.ModelRunner.commit` calls): one
Triton launch each on CUDA, their torch references on other devices.

    move_kv_rows(k_pool, v_pool, slots, ctx, path, path_len)
        KV pools ``[L, S, max_len, H, D]``: row ``ctx[r] + path[r, p]`` -> row ``ctx[r] + p`` of
        slot ``slots[r]`` for ``p < path_len[r]``, in every layer.
    commit_conv_state(pool, inputs, code, slots, path_len)
        conv state ``[L, S, C, K-1]``: column j of slot ``slots[r]`` becomes the conv input of
        node ``code[r, j]`` (``inputs [L, N, C]``) where ``code >= 0``, else the state's own
        column ``(-code - 1) mod (K-1)``.

Each program reads every row it needs before writing any (a barrier between), so a path whose
source rows overlap its destinations moves as if copied through a temporary. Rows of
``path_len == 0`` (padding) are left untouched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["move_kv_rows", "commit_conv_state", "move_kv_rows_reference",
           "commit_conv_state_reference"]


@triton.jit
def _move_rows(pool, base, src, dst, pm, E, EB: tl.constexpr):
    for e0 in range(0, E, EB):
        e = e0 + tl.arange(0, EB)
        m = pm[:, None] & (e < E)[None, :]
        rows = tl.load(pool + base + src[:, None] * E + e[None, :], mask=m)
        tl.debug_barrier()                     # every source row read before any is written
        tl.store(pool + base + dst[:, None] * E + e[None, :], rows, mask=m)
        tl.debug_barrier()


@triton.jit
def _move_kv_kernel(k_pool, v_pool, slots, ctx, path, path_len, stride_layer, stride_slot, E,
                    P: tl.constexpr, PB: tl.constexpr, EB: tl.constexpr):
    r = tl.program_id(0)
    lw = tl.program_id(1)                      # layer * 2 + (0: keys, 1: values)
    n = tl.load(path_len + r)
    if n > 0:
        base = (lw // 2).to(tl.int64) * stride_layer + tl.load(slots + r).to(tl.int64) * stride_slot
        c = tl.load(ctx + r).to(tl.int64)
        p = tl.arange(0, PB)
        pm = p < n
        src = c + tl.load(path + r * P + p, mask=pm, other=0).to(tl.int64)
        dst = c + p.to(tl.int64)
        if lw % 2 == 0:
            _move_rows(k_pool, base, src, dst, pm, E, EB)
        else:
            _move_rows(v_pool, base, src, dst, pm, E, EB)


def move_kv_rows(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                 ctx: torch.Tensor, path: torch.Tensor, path_len: torch.Tensor, *,
                 impl: str = "auto") -> None:
    """Move each accepted path's KV rows into place, every layer, keys and values.

    ``k_pool, v_pool [L, S, max_len, H, D]`` contiguous; ``slots, ctx, path_len [R]``; ``path
    [R, P]`` local node indices root first. ``impl``: "triton" (one launch: CUDA tensors, or
    the CPU interpreter), "torch" (:func:`move_kv_rows_reference`) or "auto" (Triton on CUDA)."""
    if impl == "torch" or (impl == "auto" and k_pool.device.type != "cuda"):
        return move_kv_rows_reference(k_pool, v_pool, slots, ctx, path, path_len)
    L, S, M = k_pool.shape[:3]
    R, P = path.shape
    if L == 0 or R == 0:
        return
    if not (k_pool.is_contiguous() and v_pool.is_contiguous() and v_pool.shape == k_pool.shape):
        raise ValueError("move_kv_rows takes contiguous KV pools of one shape")
    E = k_pool[0, 0, 0].numel()
    PB = triton.next_power_of_2(P)
    _move_kv_kernel[(R, 2 * L)](
        k_pool, v_pool, slots.to(torch.int64).contiguous(), ctx.to(torch.int64).contiguous(),
        path.to(torch.int64).contiguous(), path_len.to(torch.int64).contiguous(),
        k_pool.stride(0), k_pool.stride(1), E, P=P, PB=PB,
        EB=max(16, min(triton.next_power_of_2(E), 4096 // PB)), num_warps=4)


def move_kv_rows_reference(k_pool, v_pool, slots, ctx, path, path_len) -> None:
    """The same with torch indexing: all rows read before any is written; a row past a path's
    length is copied onto itself (fixed shapes, no host synchronisation)."""
    R, P = path.shape
    col = torch.arange(P, device=path.device)[None, :]
    dst = ctx.long()[:, None] + col
    src = torch.where(col < path_len[:, None], ctx.long()[:, None] + path, dst)
    s = slots.long()[:, None].expand(R, P)
    for pool in (k_pool, v_pool):
        pool[:, s, dst] = pool[:, s, src]


@triton.jit
def _conv_commit_kernel(pool, inputs, code, slots, path_len, stride_layer, stride_slot,
                        stride_in_layer, stride_in_row, C, W: tl.constexpr, WB: tl.constexpr,
                        CB: tl.constexpr):
    r = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    n = tl.load(path_len + r)
    if n > 0:
        j = tl.arange(0, WB)
        jm = j < W
        cd = tl.load(code + r * W + j, mask=jm, other=-1).to(tl.int64)
        fresh = cd >= 0
        col = (-cd - 1) % W
        base = layer * stride_layer + tl.load(slots + r).to(tl.int64) * stride_slot
        for c0 in range(0, C, CB):
            c = c0 + tl.arange(0, CB)
            m = (c < C)[:, None] & jm[None, :]
            x = tl.load(inputs + layer * stride_in_layer
                        + tl.maximum(cd, 0)[None, :] * stride_in_row + c[:, None],
                        mask=m & fresh[None, :], other=0.0)
            old = tl.load(pool + base + c[:, None] * W + col[None, :], mask=m & ~fresh[None, :],
                          other=0.0)
            new = tl.where(fresh[None, :], x.to(pool.dtype.element_ty), old)
            tl.debug_barrier()                 # the old columns read before any is written
            tl.store(pool + base + c[:, None] * W + j[None, :], new, mask=m)
            tl.debug_barrier()


def commit_conv_state(pool: torch.Tensor, inputs: torch.Tensor, code: torch.Tensor,
                      slots: torch.Tensor, path_len: torch.Tensor, *, impl: str = "auto") -> None:
    """Each request's conv state from its accepted node's window, every GDN layer.

    ``pool [L, S, C, K-1]`` contiguous; ``inputs [L, N, C]`` the forward's conv inputs (any
    layer and row strides: e.g. the conv columns of every layer's stacked input projection);
    ``code [R, K-1]`` the accepted node's window without the node itself (``>= 0``: a flat node
    index; else ``-(r * (K-1) + col) - 1``, the state's column col); ``slots, path_len [R]``.
    ``impl`` as for :func:`move_kv_rows` (one launch, or :func:`commit_conv_state_reference`)."""
    if impl == "torch" or (impl == "auto" and pool.device.type != "cuda"):
        return commit_conv_state_reference(pool, inputs, code, slots, path_len)
    L, S, C, W = pool.shape
    R = code.shape[0]
    if L == 0 or R == 0:
        return
    if not pool.is_contiguous():
        raise ValueError("commit_conv_state takes a contiguous conv-state pool")
    if inputs.stride(2) != 1:
        inputs = inputs.contiguous()
    _conv_commit_kernel[(R, L)](
        pool, inputs, code.contiguous(), slots.to(torch.int64).contiguous(),
        path_len.to(torch.int64).contiguous(), pool.stride(0), pool.stride(1), inputs.stride(0),
        inputs.stride(1), C, W=W, WB=triton.next_power_of_2(W),
        CB=min(256, triton.next_power_of_2(C)), num_warps=4)


def commit_conv_state_reference(pool, inputs, code, slots, path_len) -> None:
    """The same with torch indexing."""
    W = pool.shape[-1]
    slots = slots.long()
    code = code.long()
    x = inputs[:, code.clamp(min=0)].transpose(-1, -2)                 # [L, R, C, W]
    col = ((-code - 1) % W).clamp(min=0)
    old = pool[:, slots]
    s = torch.gather(old, 3, col[None, :, None, :].expand_as(old))
    new = torch.where(code[None, :, None, :] >= 0, x.to(pool.dtype), s)
    pool[:, slots] = torch.where((path_len > 0)[None, :, None, None], new, old)
