"""The KV pool's writes: a batch's new keys and values into each request's scratch rows."""

from __future__ import annotations

import torch

from bole.ops.attention.checks import _check_pools, _check_requests, _need_tensor

__all__ = ["write_kv"]


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor, ctx_lens: torch.Tensor) -> None:
    """Write the new nodes' keys and values into their requests' scratch regions, in place.

    ``k, v [N, Hkv, D]`` with ``N = R * Tk``: row ``r * Tk + j`` goes to pool position
    ``(slots[r], ctx_lens[r] + j)`` of ``k_pool, v_pool [S, M, Hkv, D]``; ``slots, ctx_lens [R]``.
    One ``index_put_`` per pool (graph-safe). The caller reserves the scratch positions,
    ``ctx_lens[r] + Tk <= M``; a position past M is never written out of bounds: torch's bounds
    check raises (IndexError on the CPU, a device-side assert on CUDA).
    """
    _check_pools(k_pool, v_pool)
    for name, x in (("k", k), ("v", v)):
        _need_tensor(x, name)
        if x.dim() != 3 or tuple(x.shape[1:]) != tuple(k_pool.shape[2:]):
            raise ValueError(f"{name} must be [N, Hkv, D] = [N, {k_pool.shape[2]}, {k_pool.shape[3]}], "
                             f"got {tuple(x.shape)}")
        if x.dtype != k_pool.dtype or x.device != k_pool.device:
            raise TypeError(f"{name} ({x.dtype}, {x.device}) must match the pool "
                            f"({k_pool.dtype}, {k_pool.device})")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    R = _check_requests(slots, ctx_lens, k.shape[0], k_pool.device)
    Tk = k.shape[0] // R
    pos = ctx_lens.long()[:, None] + torch.arange(Tk, device=k.device)       # [R, Tk]
    index = (slots.long()[:, None].expand(R, Tk).reshape(-1), pos.reshape(-1))
    k_pool.index_put_(index, k)
    v_pool.index_put_(index, v)
