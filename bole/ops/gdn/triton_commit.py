"""Cross-layer factored commit (Algorithm 2) in one Triton launch, in place in the state pool.

After acceptance every request r has an accepted path ``p = A(a) + {a}`` (root first, ``a`` the
accepted node). For every GDN layer l, request r and value head h (docs/design.md
section 3):

    S_new = e^{L_a} S_pre + sum_{j in p} e^{L_a - L_j} k_j u_j^T

with ``S_pre`` the pool slot ``state_indices[r]`` of layer l, which is overwritten by ``S_new``.
``k_j`` is the effective key of key head ``h // (H_v // H_k)`` (``k * k_inv_norm`` when the factors
carry the inverse norms). The weights come from the differences ``L_a - L_j`` (<= 0 on the path),
masked to -inf off the path *before* exp; separate exponentials are never formed.

Kernel: one program per (layer, request, value head) x (d_v tile of ``BV`` columns). It loads the
path's weighted corrections ``w_j u_j`` ``[BP, BV]`` once (``BP`` >= the longest path), then
streams its ``[d_k, BV]`` column block of ``S_pre`` in ``[BK, BV]`` tiles (the loop's loads are
pipelined): each tile is scaled, gets ``K_p^T (w U_p)`` by ``tl.dot`` in fp32 ("ieee": no TF32
rounding; "tf32x3" measured slower) and is written back. Each program reads only the tiles it then
overwrites, so in place is hazard-free as long as ``state_indices`` holds distinct slots.

The torch oracle is :func:`bole.ops.gdn.closed_form.commit_factored`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bole.ops.gdn.closed_form import TreeFactors
from bole.ops.triton_utils import check_kernel_device, fix_interpreter_scalar_index

__all__ = ["commit_factored_triton"]

fix_interpreter_scalar_index()


@triton.jit(do_not_specialize=["R", "N", "P"])
def _factored_commit_kernel(
    L, kk, k_inv, u,              # [Ly, N, HV], [Ly, N, HK, K], [Ly, N, HK] or None, [Ly, N, HV, V]
    pool,                         # [Ly, S, HV, K, V] fp32, last three dims contiguous
    state_indices,                # [R]
    path_index, path_lengths,     # [R, P] (row-contiguous), [R]
    R, N, P,
    stride_pool_layer, stride_pool_slot,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BP: tl.constexpr,
    HAS_K_INV: tl.constexpr,
):
    i_lrh, i_v = tl.program_id(0), tl.program_id(1)
    i_hv = i_lrh % HV
    i_r = (i_lrh // HV) % R
    i_l = (i_lrh // (HV * R)).to(tl.int64)
    i_h = i_hv // (HV // HK)

    n = tl.load(path_lengths + i_r).to(tl.int32)
    slot = tl.load(state_indices + i_r).to(tl.int64)
    if (n > 0) & (slot >= 0):
        row = path_index + i_r.to(tl.int64) * P
        node0 = i_l * N                                   # first node of this layer
        a = tl.load(row + n - 1).to(tl.int64)             # the accepted node
        b_La = tl.load(L + (node0 + a) * HV + i_hv)      # fp64 (or fp32) path log-decay
        decay_a = tl.exp(b_La.to(tl.float32))
        o_v = i_v * BV + tl.arange(0, BV)
        mask_v = o_v < V
        # the path's weighted corrections w_j u_j, [BP, BV], once per program (paths fit in BP)
        o_p = tl.arange(0, BP)
        mask_p = o_p < n
        idx = node0 + tl.load(row + o_p, mask=mask_p, other=0).to(tl.int64)       # [BP]
        b_Lj = tl.load(L + idx * HV + i_hv, mask=mask_p, other=0.0)
        # the difference in L's precision (fp64 factors), then exp in fp32, masked first
        b_w = tl.exp(tl.where(mask_p, (b_La - b_Lj).to(tl.float32), float("-inf")))      # [BP]
        if HAS_K_INV:
            b_w = b_w * tl.load(k_inv + idx * HK + i_h, mask=mask_p, other=0.0).to(tl.float32)
        b_u = tl.load(u + (idx[:, None] * HV + i_hv) * V + o_v[None, :],
                      mask=mask_p[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
        b_u = b_u * b_w[:, None]
        p_state = pool + i_l * stride_pool_layer + slot * stride_pool_slot + i_hv * K * V
        # stream the [K, BV] column block of the state in [BK, BV] tiles (pipelined loads)
        for k0 in range(0, K, BK):
            o_k = k0 + tl.arange(0, BK)
            mask_k = o_k < K
            p_s = p_state + o_k[:, None] * V + o_v[None, :]
            mask_s = mask_k[:, None] & mask_v[None, :]
            b_s = tl.load(p_s, mask=mask_s, other=0.0).to(tl.float32) * decay_a
            b_kt = tl.load(kk + (idx[None, :] * HK + i_h) * K + o_k[:, None],
                           mask=mask_k[:, None] & mask_p[None, :], other=0.0).to(tl.float32)
            b_s = tl.dot(b_kt, b_u, acc=b_s, input_precision="ieee")
            tl.store(p_s, b_s.to(pool.dtype.element_ty), mask=mask_s)


def _check_int_tensor(name: str, x, shape: tuple[int, ...], device) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got {x.dtype}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {shape}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but state_pool is on {device}")


def _stacked(factors: TreeFactors, state_pool: torch.Tensor):
    """``(log_decay, k, u, k_inv_norm, pool, single)`` with a leading layer dim (one layer's
    factors and pool gain one; ``single`` says so)."""
    if not isinstance(factors, TreeFactors):
        raise TypeError(f"factors must be TreeFactors, got {type(factors).__name__}")
    if not isinstance(state_pool, torch.Tensor):
        raise TypeError(f"state_pool must be a torch.Tensor, got {type(state_pool).__name__}")
    L, k, u, k_inv = factors.log_decay, factors.k, factors.u, factors.k_inv_norm
    single = L.dim() == 2
    if single:
        if state_pool.dim() != 4:
            raise ValueError(
                f"one layer's factors need a pool [S, H_v, d_k, d_v], got shape "
                f"{tuple(state_pool.shape)}")
        L, k, u = L[None], k[None], u[None]
        k_inv = None if k_inv is None else k_inv[None]
        pool = state_pool.unsqueeze(0)
    else:
        if L.dim() != 3:
            raise ValueError(f"log_decay must be [N, H_v] or [Ly, N, H_v], got {tuple(L.shape)}")
        if state_pool.dim() != 5:
            raise ValueError(
                f"stacked factors need a pool [Ly, S, H_v, d_k, d_v], got shape "
                f"{tuple(state_pool.shape)}")
        pool = state_pool
    return L, k, u, k_inv, pool, single


def _checked_shapes(factors: TreeFactors, state_pool: torch.Tensor, L, k, u, k_inv, pool,
                    single: bool) -> tuple[int, int, int, int, int, int]:
    """The stacked factors and pool checked against each other: ``(Ly, N, H_v, H_k, d_k, d_v)``."""
    Ly, N, H_v = L.shape
    if k.dim() != 4 or k.shape[:2] != (Ly, N):
        raise ValueError(f"factors.k has shape {tuple(factors.k.shape)}, expected [.., {N}, H_k, d_k]")
    H_k, d_k = k.shape[2], k.shape[3]
    if u.dim() != 4 or u.shape[:3] != (Ly, N, H_v):
        raise ValueError(
            f"factors.u has shape {tuple(factors.u.shape)}, expected [.., {N}, {H_v}, d_v]")
    d_v = u.shape[3]
    if H_v % H_k != 0:
        raise ValueError(f"value heads H_v={H_v} must be a multiple of key heads H_k={H_k}")
    if k_inv is not None and tuple(k_inv.shape) != (Ly, N, H_k):
        raise ValueError(
            f"factors.k_inv_norm has shape {tuple(factors.k_inv_norm.shape)}, expected "
            f"{(N, H_k) if single else (Ly, N, H_k)}")
    if pool.dtype != torch.float32:
        raise TypeError(f"state_pool has dtype {pool.dtype}; the Triton commit keeps fp32 state")
    if pool.shape[0] != Ly or tuple(pool.shape[2:]) != (H_v, d_k, d_v):
        raise ValueError(
            f"state_pool has shape {tuple(state_pool.shape)}, expected "
            f"{'' if single else f'[Ly={Ly}, '}S, H_v={H_v}, d_k={d_k}, d_v={d_v}]")
    if pool.stride()[2:] != (d_k * d_v, d_v, 1):
        raise ValueError("state_pool must be contiguous in its last three dims [H_v, d_k, d_v]")
    check_kernel_device(pool.device, "commit_factored_triton")
    for name, x in (("log_decay", L), ("k", k), ("u", u), ("k_inv_norm", k_inv)):
        if x is not None:
            if not x.dtype.is_floating_point:
                raise TypeError(f"factors.{name} must be floating point, got {x.dtype}")
            if x.device != pool.device:
                raise ValueError(f"factors.{name} is on {x.device} but state_pool is on {pool.device}")
    return Ly, N, H_v, H_k, d_k, d_v


def _checked_paths(state_indices: torch.Tensor, path_index: torch.Tensor,
                   path_lengths: torch.Tensor, pool: torch.Tensor, N: int,
                   check_values: bool) -> tuple[int, int]:
    """The slots and accepted paths checked (their values too when ``check_values``):
    ``(R, P)``."""
    if not isinstance(state_indices, torch.Tensor) or state_indices.dim() != 1:
        raise ValueError("state_indices must be a 1-D integer tensor [R]")
    R = state_indices.shape[0]
    if not isinstance(path_index, torch.Tensor) or path_index.dim() != 2:
        raise ValueError("path_index must be a 2-D integer tensor [R, P]")
    P = path_index.shape[1]
    _check_int_tensor("state_indices", state_indices, (R,), pool.device)
    _check_int_tensor("path_index", path_index, (R, P), pool.device)
    _check_int_tensor("path_lengths", path_lengths, (R,), pool.device)
    if check_values and R:
        S = pool.shape[1]
        if bool((state_indices >= S).any()):
            raise ValueError(f"state_indices {state_indices.tolist()} out of range for {S} slots")
        used = state_indices[state_indices >= 0]
        if used.unique().numel() != used.numel():
            raise ValueError(f"state_indices {state_indices.tolist()} repeat a slot")
        if bool(((path_lengths < 0) | (path_lengths > P)).any()):
            raise ValueError(f"path_lengths {path_lengths.tolist()} must lie in 0..{P}")
        live = torch.arange(P, device=pool.device)[None, :] < path_lengths[:, None]
        if bool(((path_index < 0) | (path_index >= N))[live].any()):
            raise ValueError(f"path_index holds node indices outside 0..{N - 1}")
    return R, P


def commit_factored_triton(
    factors: TreeFactors, state_pool: torch.Tensor, state_indices: torch.Tensor,
    path_index: torch.Tensor, path_lengths: torch.Tensor, *,
    block_k: int | None = None, block_v: int | None = None,
    num_warps: int = 4, num_stages: int = 3, check_values: bool = False,
) -> torch.Tensor:
    """Commit the accepted paths of every layer, request and head in one launch, in place.

    Args:
        factors: :class:`TreeFactors` stacked over layers (``log_decay [Ly, N, H_v]``,
            ``k [Ly, N, H_k, d_k]``, ``u [Ly, N, H_v, d_v]``, optional ``k_inv_norm [Ly, N, H_k]``),
            or one layer without the leading dim. ``k`` may be fp16/bf16/fp32; math is fp32.
        state_pool: fp32 ``[Ly, S, H_v, d_k, d_v]`` (or ``[S, H_v, d_k, d_v]`` for one layer),
            contiguous in its last three dims. Slot ``state_indices[r]`` holds request r's S_pre
            and receives S_new; other slots are untouched.
        state_indices: ``[R]`` distinct pool slots; a negative slot skips the request.
        path_index: ``[R, P]`` packed node indices of each accepted path, root first, padded
            (entries past ``path_lengths[r]`` are ignored); see ``PackedForest.padded_paths``.
        path_lengths: ``[R]``; 0 skips the request (nothing written).
        block_k, block_v, num_warps, num_stages: launch configuration: ``block_v`` state columns
            per program, streamed ``block_k`` rows at a time. The whole path is one ``tl.dot``
            operand (``max(16, next_pow2(P))`` rows). The defaults (16, 64, 4 warps, 3 stages)
            were the fastest of 56 launches at every batch on the H200 (bench/NOTES.md, Commit).
        check_values: also check index ranges and distinct slots (syncs with the device).

    Returns ``state_pool``.
    """
    L, k, u, k_inv, pool, single = _stacked(factors, state_pool)
    Ly, N, H_v, H_k, d_k, d_v = _checked_shapes(factors, state_pool, L, k, u, k_inv, pool, single)
    R, P = _checked_paths(state_indices, path_index, path_lengths, pool, N, check_values)
    if R == 0 or P == 0:
        return state_pool
    BK = block_k or 16
    BV = block_v or min(64, max(16, triton.next_power_of_2(d_v)))
    BP = max(16, triton.next_power_of_2(P))               # the whole path in one tl.dot
    grid = (Ly * R * H_v, triton.cdiv(d_v, BV))
    _factored_commit_kernel[grid](
        L.contiguous(), k.contiguous(), None if k_inv is None else k_inv.contiguous(),
        u.contiguous(), pool, state_indices.contiguous(), path_index.contiguous(),
        path_lengths.contiguous(), R, N, P, pool.stride(0), pool.stride(1),
        HK=H_k, HV=H_v, K=d_k, V=d_v, BK=BK, BV=BV, BP=BP, HAS_K_INV=k_inv is not None,
        num_warps=num_warps, num_stages=num_stages)
    return state_pool
