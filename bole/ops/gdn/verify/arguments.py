"""The verification kernel's arguments checked before a launch: dtypes, shapes, devices, the
forest's metadata and each request's state slot."""

from __future__ import annotations

import torch

from bole.ops.gdn.closed_form import NEUMANN_MAX_DEPTH_FP32
from bole.ops.gdn.common import check_gdn_tensors
from bole.ops.gdn.verify.configs import PRECISIONS
from bole.ops.triton_utils import check_kernel_device, check_same_device
from bole.tree import ForestMeta

__all__ = ["KERNEL_INPUT_DTYPES", "checked_arguments"]

#: q, k and v dtypes the kernel takes
KERNEL_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def checked_arguments(q, k, v, meta, g, beta, a, b, A_log, dt_bias, initial_state,
                       state_indices, precision, out_dtype, check_values):
    """:func:`~bole.ops.gdn.verify.kernel.tree_gdn_verify_triton`'s arguments checked: ``(precision, (B, T, H_k, d_k, H_v,
    d_v), state_indices)``, the default precision and slots filled in."""
    if not isinstance(meta, ForestMeta):
        raise TypeError(f"meta must be a ForestMeta (PackedForest.kernel_meta), got {type(meta).__name__}")
    if precision is None:
        precision = "tf32" if getattr(q, "dtype", None) in (torch.float16, torch.bfloat16) else "ieee"
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if initial_state is None:
        raise ValueError("initial_state (the state pool [S, H_v, d_k, d_v]) is required")
    if out_dtype is not None and out_dtype not in KERNEL_INPUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.float16, torch.bfloat16 or torch.float32, got {out_dtype}")

    # raw gates are validated but not computed here: the kernel fuses the gating
    B, T, H_k, d_k, H_v, d_v, _, _ = check_gdn_tensors(
        q, k, v, g, beta, a, b, A_log, dt_bias, initial_state, None, check_values,
        resolve_raw_gates=False)
    check_kernel_device(q.device, "tree_gdn_verify_triton")
    if q.dtype not in KERNEL_INPUT_DTYPES:
        raise TypeError(
            f"the Triton kernel takes fp16, bf16 or fp32 q/k/v, got {q.dtype}; "
            "use tree_gdn_closed_form for fp64")
    if initial_state.dtype != torch.float32:
        raise TypeError(f"initial_state has dtype {initial_state.dtype}; the Triton kernel reads an fp32 pool")
    if initial_state.dim() != 4 or tuple(initial_state.shape[1:]) != (H_v, d_k, d_v):
        raise ValueError(
            f"initial_state has shape {tuple(initial_state.shape)}, expected a state pool "
            f"[S, H_v={H_v}, d_k={d_k}, d_v={d_v}]")

    if int(meta.max_depth) > NEUMANN_MAX_DEPTH_FP32:
        raise ValueError(
            f"a tree of depth {meta.max_depth} can overflow the kernel's fp32 Neumann sweeps "
            f"(their iterates grow like (1 + beta)^depth before they converge); verify trees of "
            f"depth <= {NEUMANN_MAX_DEPTH_FP32} (split long chains into chunks) or use "
            f"tree_gdn_closed_form, which solves deeper trees by substitution")
    N, R, BT = meta.num_nodes, meta.num_requests, meta.block_nodes
    if B * T != N:
        raise ValueError(
            f"inputs carry B*T = {B}*{T} = {B * T} nodes but the forest has {N}; "
            "pass a packed forest as B=1, T=N")
    if BT < 16 or BT & (BT - 1) or BT < meta.max_tree_nodes:
        raise ValueError(
            f"meta.block_nodes={BT} must be a power of two >= max(16, max_tree_nodes={meta.max_tree_nodes})")
    if tuple(meta.ancestor_mask.shape) != (N, BT) or meta.ancestor_mask.dtype != torch.uint8:
        raise ValueError(
            f"meta.ancestor_mask must be uint8 [N={N}, block_nodes={BT}], got "
            f"{meta.ancestor_mask.dtype} {tuple(meta.ancestor_mask.shape)}")
    if tuple(meta.cu_nodes.shape) != (R + 1,) or meta.cu_nodes.dtype != torch.int32:
        raise ValueError(f"meta.cu_nodes must be int32 [R + 1 = {R + 1}], got "
                         f"{meta.cu_nodes.dtype} {tuple(meta.cu_nodes.shape)}")

    state_indices = _state_slots(state_indices, initial_state.shape[0], R, check_values, q.device)
    check_same_device(q.device, v=v, g=g, beta=beta, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
                      initial_state=initial_state, state_indices=state_indices,
                      cu_nodes=meta.cu_nodes, ancestor_mask=meta.ancestor_mask)
    return precision, (B, T, H_k, d_k, H_v, d_v), state_indices


def _state_slots(state_indices, S: int, R: int, check_values: bool, device) -> torch.Tensor:
    """Each request's slot in a pool of ``S`` states: ``state_indices`` checked, or ``arange(R)``
    when the pool holds exactly the ``R`` requests."""
    if state_indices is None:
        if S != R:
            raise ValueError(
                f"the state pool has {S} slots but the forest has {R} requests; "
                "pass state_indices to say which slot each request reads")
        state_indices = torch.arange(R, dtype=torch.int32, device=device)
    else:
        if not isinstance(state_indices, torch.Tensor) or state_indices.dtype not in (torch.int32, torch.int64):
            raise TypeError("state_indices must be an int32 or int64 tensor")
        if tuple(state_indices.shape) != (R,):
            raise ValueError(
                f"state_indices has shape {tuple(state_indices.shape)}, expected [R={R}], one slot per request")
        if check_values and R and bool(((state_indices < 0) | (state_indices >= S)).any()):
            raise ValueError(f"state_indices must lie in [0, {S}) (the pool's slots)")
    return state_indices
