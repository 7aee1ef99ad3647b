"""The attention calls' input checks: shapes, dtypes and devices only (values live on the
device and are never read here)."""

from __future__ import annotations

import torch

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX = (torch.int32, torch.int64)


def _need_tensor(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def _check_pools(k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
    _need_tensor(k_pool, "k_pool")
    _need_tensor(v_pool, "v_pool")
    if k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool and v_pool must both be [S, M, Hkv, D], got shapes "
                         f"{tuple(k_pool.shape)} and {tuple(v_pool.shape)}")
    if k_pool.dtype != v_pool.dtype or k_pool.dtype not in _FLOATS:
        raise TypeError(f"k_pool ({k_pool.dtype}) and v_pool ({v_pool.dtype}) must share one "
                        f"floating dtype")
    if k_pool.device != v_pool.device:
        raise ValueError(f"k_pool is on {k_pool.device} but v_pool on {v_pool.device}")


def _check_requests(slots: torch.Tensor, ctx_lens: torch.Tensor, N: int, device) -> int:
    """Check ``slots, ctx_lens [R]`` against N rows; return R."""
    for name, x in (("slots", slots), ("ctx_lens", ctx_lens)):
        _need_tensor(x, name)
        if x.dim() != 1 or x.numel() == 0:
            raise ValueError(f"{name} must be a non-empty 1-D tensor [R], got shape {tuple(x.shape)}")
        if x.dtype not in _INDEX:
            raise TypeError(f"{name} must be int32 or int64, got {x.dtype}")
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but the pool on {device}")
    R = slots.shape[0]
    if ctx_lens.shape[0] != R:
        raise ValueError(f"slots has {R} requests but ctx_lens {ctx_lens.shape[0]}")
    if N % R:
        raise ValueError(f"{N} rows are not a multiple of the {R} requests (N must be R * Tq)")
    return R


def _check_gate(gate: torch.Tensor | None, q: torch.Tensor) -> None:
    if gate is None:
        return
    _need_tensor(gate, "gate")
    N, Hq, D = q.shape
    if tuple(gate.shape) not in ((N, Hq * D), (N, Hq, D)):
        raise ValueError(f"gate must be [N, Hq * D] = {(N, Hq * D)} or [N, Hq, D], got "
                         f"{tuple(gate.shape)}")
    if gate.dtype != q.dtype or gate.device != q.device:
        raise TypeError(f"gate ({gate.dtype}, {gate.device}) must match q ({q.dtype}, {q.device})")


def _check_query(q: torch.Tensor, k_pool: torch.Tensor) -> None:
    _need_tensor(q, "q")
    if q.dim() != 3:
        raise ValueError(f"q must be [N, Hq, D], got shape {tuple(q.shape)}")
    Hkv, D = k_pool.shape[2], k_pool.shape[3]
    if q.shape[2] != D:
        raise ValueError(f"q has head dim {q.shape[2]} but the pool {D}")
    if q.shape[1] % Hkv:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of the pool's {Hkv} kv heads")
    if q.dtype != k_pool.dtype:
        raise TypeError(f"q ({q.dtype}) and the pool ({k_pool.dtype}) must share one dtype")
    if q.device != k_pool.device:
        raise ValueError(f"q is on {q.device} but the pool on {k_pool.device}")


def _check_tree(q, k_pool, v_pool, slots, ctx_lens, tree_mask, gate) -> tuple[int, int, int]:
    """Validate a tree-attention call; return ``(R, Tq, Tk)``."""
    _check_pools(k_pool, v_pool)
    _check_query(q, k_pool)
    R = _check_requests(slots, ctx_lens, q.shape[0], k_pool.device)
    _need_tensor(tree_mask, "tree_mask")
    if tree_mask.dtype not in (torch.bool, torch.uint8):
        raise TypeError(f"tree_mask must be bool or uint8, got {tree_mask.dtype}")
    if tree_mask.dim() != 2 or tree_mask.shape[0] != q.shape[0]:
        raise ValueError(f"tree_mask must be [N, Tk] with N = {q.shape[0]}, got {tuple(tree_mask.shape)}")
    Tk = tree_mask.shape[1]
    if not 1 <= Tk <= k_pool.shape[1]:
        raise ValueError(f"tree_mask has {Tk} scratch keys; need 1 <= Tk <= M = {k_pool.shape[1]}")
    if tree_mask.device != q.device:
        raise ValueError(f"tree_mask is on {tree_mask.device} but q on {q.device}")
    _check_gate(gate, q)
    return R, q.shape[0] // R, Tk
