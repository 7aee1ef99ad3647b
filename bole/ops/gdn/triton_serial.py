"""Serial-snapshot GDN kernels: the ``tree-serial`` and ``chain`` baselines, in Triton.

These are the baselines Bole is measured against, written to be faithful to today's engines so that
comparisons are like for like (docs/design.md sections 5 and 8):

* :func:`tree_gdn_serial_triton` -- SGLang's (and vLLM's) EAGLE-tree design: one program per
  (request, value head, value tile) walks its request's nodes in topological order with the state
  tile ``[d_k, BV]`` in registers, reloads the parent's state from the HBM snapshot buffer when the
  parent is not the node just processed, and stores one full fp32 snapshot per node.
* :func:`chain_gdn_snapshots_triton` -- vLLM's ``chain`` mode: ``B`` chains of ``T`` drafts, one
  snapshot per position. Same kernel; a chain never reloads.
* :func:`commit_from_snapshots_triton` -- the copy-commit of both: the accepted node's snapshot is
  copied into the request's pool slot (optionally for all layers at once).

The update per node is fla's ``fused_recurrent`` step (state layout ``[d_k, d_v]``, fp32):

    S *= exp(g);  u = beta (v - S^T k);  S += k u^T;  o = S^T q

Tiling follows fla/SGLang/vLLM: ``BK = next_pow2(d_k)`` (the whole key dim in one tile) and a small
value tile ``BV`` (the engines use 8 with one warp). ``block_v``, ``num_warps`` and ``num_stages`` are
parameters so that a benchmark can tune the baseline (:data:`SERIAL_TUNING_SPACE`).

Semantics match :func:`bole.ops.gdn.reference.tree_gdn_serial` (the oracle): same layout, gates,
in-kernel l2norm, scale and grouped value heads. Differences, all documented here:

* ``initial_state`` is a *pool* ``[S, H_v, d_k, d_v]`` read (never written) at slot
  ``state_indices[r]`` (default ``arange(R)``); a negative slot means a zero initial state (SGLang's
  ``h0_indices`` convention for padded requests).
* Padding nodes of the forest get ``o = 0``; their snapshot rows are not written (left as they were,
  uninitialised when the buffer is allocated here).
* The gates may be fused from the raw ``a, b`` projections inside the kernel; softplus uses the
  engines' form ``x if x > 20 else log(1 + exp(x))``.
* All arithmetic is fp32 (fp64 inputs are accepted by the shared validation but computed in fp32).
* Validation runs :func:`~bole.ops.gdn.common.check_gdn_tensors` on ``meta`` copies unless
  ``check_values`` is set, so the hot path issues no device work besides the launch (plus the
  zero-fill of ``o`` in tree mode, for the padding rows).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from bole.ops.gdn.common import check_gdn_tensors
from bole.ops.triton_utils import (check_kernel_device, check_same_device,
                                   fix_interpreter_scalar_index)
from bole.tree import ForestMeta

__all__ = [
    "tree_gdn_serial_triton",
    "chain_gdn_snapshots_triton",
    "commit_from_snapshots_triton",
    "serial_default_config",
    "SERIAL_TUNING_SPACE",
]

fix_interpreter_scalar_index()

# Candidate (block_v, num_warps) pairs for tuning the baseline on a GPU; the engines ship (8, 1).
# Pairs left out spill registers at d_k = 128 on sm_90 (ptxas: BV=32 with one warp spills ~6 KB).
SERIAL_TUNING_SPACE = ((8, 1), (8, 2), (16, 1), (16, 2), (16, 4), (32, 2), (32, 4), (64, 4), (64, 8))


def serial_default_config(d_v: int) -> dict:
    """The engines' launch configuration: ``BV = min(next_pow2(d_v), 8)``, one warp, 3 stages."""
    return {"block_v": min(triton.next_power_of_2(d_v), 8), "num_warps": 1, "num_stages": 3}


@triton.jit(do_not_specialize=["T_chain"])
def _serial_gdn_fwd_kernel(
    q, k, v,                      # [N, HK, K], [N, HK, K], [N, HV, V] (contiguous)
    g, beta,                      # [N, HV] or None
    a, b, A_log, dt_bias,         # raw gates [N, HV], [N, HV], [HV], [HV] or None
    o,                            # [N, HV, V]
    h0, state_indices,            # pool [S, HV, K, V] (last three dims contiguous), [R]
    snap,                         # [N, HV, K, V] fp32
    cu_nodes, parent,             # [R + 1], [N] (tree mode) or None (chain mode)
    scale,
    T_chain,                      # chain length (chain mode)
    stride_h0_slot,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    IS_CHAIN: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, RAW_GATES: tl.constexpr,
    USE_QK_L2NORM_IN_KERNEL: tl.constexpr, ALWAYS_RELOAD: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // HK)
    if IS_CHAIN:
        bos = i_n.to(tl.int64) * T_chain
        eos = bos + T_chain
    else:
        bos = tl.load(cu_nodes + i_n).to(tl.int64)
        eos = tl.load(cu_nodes + i_n + 1).to(tl.int64)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    # offsets of this (head, value tile) inside one [HV, K, V] state
    o_h = i_hv * K * V + o_k[:, None] * V + o_v[None, :]

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        slot = tl.load(state_indices + i_n).to(tl.int64)
        if slot >= 0:
            b_h += tl.load(h0 + slot * stride_h0_slot + o_h, mask=mask_h, other=0.0).to(tl.float32)
    if RAW_GATES:
        b_A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        b_dt = tl.load(dt_bias + i_hv).to(tl.float32)

    for t in range(bos, eos):
        if not IS_CHAIN:
            p = tl.load(parent + t).to(tl.int64)
            if ALWAYS_RELOAD:
                reload = p >= 0
            else:
                reload = (p >= 0) & (p != t - 1)
            if reload:
                # the parent's snapshot was written by this program in an earlier iteration
                tl.debug_barrier()
                b_h = tl.load(snap + p * (HV * K * V) + o_h, mask=mask_h, other=0.0).to(tl.float32)

        b_q = tl.load(q + (t * HK + i_h) * K + o_k, mask=mask_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + (t * HK + i_h) * K + o_k, mask=mask_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (t * HV + i_hv) * V + o_v, mask=mask_v, other=0.0).to(tl.float32)
        if RAW_GATES:
            x = tl.load(a + t * HV + i_hv).to(tl.float32) + b_dt
            softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
            b_g = -b_A * softplus
            b_beta = tl.sigmoid(tl.load(b + t * HV + i_hv).to(tl.float32))
        else:
            b_g = tl.load(g + t * HV + i_hv).to(tl.float32)
            b_beta = tl.load(beta + t * HV + i_hv).to(tl.float32)
        if USE_QK_L2NORM_IN_KERNEL:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        b_q = b_q * scale

        b_h *= tl.exp(b_g)
        b_v -= tl.sum(b_h * b_k[:, None], 0)
        b_v *= b_beta
        b_h += b_k[:, None] * b_v[None, :]
        b_o = tl.sum(b_h * b_q[:, None], 0)
        tl.store(o + (t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)
        tl.store(snap + t * (HV * K * V) + o_h, b_h, mask=mask_h)


def _meta_view(x):
    return x.to("meta") if isinstance(x, torch.Tensor) else x


def _validate(q, k, v, g, beta, a, b, A_log, dt_bias, initial_state, check_values):
    """Run the shared validation; on meta copies unless values are checked (no device work)."""
    if check_values:
        return check_gdn_tensors(q, k, v, g, beta, a, b, A_log, dt_bias, initial_state, None, True)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return check_gdn_tensors(
        *(_meta_view(x) for x in (q, k, v, g, beta, a, b, A_log, dt_bias, initial_state)),
        None, False)


def _launch_serial(q, k, v, g, beta, a, b, A_log, dt_bias, initial_state, state_indices, scale,
                   use_qk_l2norm_in_kernel, snapshots, check_values, num_requests, num_nodes,
                   cu_nodes, parent, T_chain, block_v, num_warps, num_stages, always_reload,
                   zero_output):
    B, T, H_k, d_k, H_v, d_v, _, _ = _validate(
        q, k, v, g, beta, a, b, A_log, dt_bias, initial_state, check_values)
    dev = q.device
    check_kernel_device(dev, "the serial Triton kernel")
    if B * T != num_nodes:
        raise ValueError(
            f"inputs carry B*T = {B}*{T} = {B * T} nodes but the forest has {num_nodes}; "
            "pass a packed forest as B=1, T=N")
    raw = g is None
    check_same_device(dev, g=g, beta=beta, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
                  initial_state=initial_state, state_indices=state_indices, snapshots=snapshots,
                  cu_nodes=cu_nodes, parent=parent)
    R = num_requests
    if initial_state is not None:
        if initial_state.dtype != torch.float32:
            raise TypeError(
                f"initial_state has dtype {initial_state.dtype}; the Triton kernels keep the state "
                "in fp32")
        if initial_state.dim() != 4 or tuple(initial_state.shape[1:]) != (H_v, d_k, d_v):
            raise ValueError(
                f"initial_state has shape {tuple(initial_state.shape)}, expected a state pool "
                f"[S, H_v={H_v}, d_k={d_k}, d_v={d_v}]")
        if initial_state.stride()[1:] != (d_k * d_v, d_v, 1):
            raise ValueError("initial_state must be contiguous in its last three dims [H_v, d_k, d_v]")
        if state_indices is None:
            if initial_state.shape[0] < R:
                raise ValueError(
                    f"initial_state holds {initial_state.shape[0]} slots but there are {R} requests; "
                    "pass state_indices to read a larger pool")
            state_indices = torch.arange(R, device=dev, dtype=torch.int32)
        else:
            if state_indices.dim() != 1 or state_indices.shape[0] != R:
                raise ValueError(
                    f"state_indices must have shape [{R}] (one slot per request), "
                    f"got {tuple(state_indices.shape)}")
            if state_indices.dtype.is_floating_point or state_indices.dtype == torch.bool:
                raise TypeError(f"state_indices must hold integers, got {state_indices.dtype}")
            if check_values and bool((state_indices >= initial_state.shape[0]).any()):
                raise ValueError(
                    f"state_indices {state_indices.tolist()} out of range for a pool of "
                    f"{initial_state.shape[0]} slots")
            state_indices = state_indices.contiguous()
    N = num_nodes
    snap_shape = (N, H_v, d_k, d_v)
    if snapshots is None:
        snapshots = torch.empty(snap_shape, dtype=torch.float32, device=dev)
    else:
        if snapshots.dtype != torch.float32:
            raise TypeError(f"snapshots must be fp32, got {snapshots.dtype}")
        if snapshots.numel() != N * H_v * d_k * d_v or not snapshots.is_contiguous():
            raise ValueError(
                f"snapshots must be a contiguous buffer of {snap_shape} (any leading split), "
                f"got shape {tuple(snapshots.shape)}")
    if scale is None:
        scale = d_k ** -0.5
    qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
    o = (torch.zeros if zero_output else torch.empty)(v.shape, dtype=v.dtype, device=dev)
    gates = ((None, None, a.contiguous(), b.contiguous(), A_log.contiguous(), dt_bias.contiguous())
             if raw else (g.contiguous(), beta.contiguous(), None, None, None, None))
    BK = triton.next_power_of_2(d_k)
    BV = block_v or serial_default_config(d_v)["block_v"]
    if BV & (BV - 1):
        raise ValueError(f"block_v must be a power of two, got {BV}")
    grid = (triton.cdiv(d_v, BV), R * H_v)
    _serial_gdn_fwd_kernel[grid](
        qc, kc, vc, *gates, o,
        initial_state, state_indices, snapshots, cu_nodes, parent,
        float(scale), T_chain,
        initial_state.stride(0) if initial_state is not None else 0,
        HK=H_k, HV=H_v, K=d_k, V=d_v, BK=BK, BV=BV,
        IS_CHAIN=cu_nodes is None, USE_INITIAL_STATE=initial_state is not None, RAW_GATES=raw,
        USE_QK_L2NORM_IN_KERNEL=bool(use_qk_l2norm_in_kernel), ALWAYS_RELOAD=bool(always_reload),
        num_warps=num_warps, num_stages=num_stages,
    )
    return o, snapshots.view(snap_shape)


def tree_gdn_serial_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: ForestMeta, *,
    g=None, beta=None, a=None, b=None, A_log=None, dt_bias=None,
    initial_state: torch.Tensor | None = None, state_indices: torch.Tensor | None = None,
    scale: float | None = None, use_qk_l2norm_in_kernel: bool = False,
    snapshots: torch.Tensor | None = None, check_values: bool = False,
    block_v: int | None = None, num_warps: int = 1, num_stages: int = 3,
    always_reload: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree verification node by node with one full state snapshot per node (``tree-serial``).

    Args:
        q, k: ``[B, T, H_k, d_k]``; v: ``[B, T, H_v, d_v]`` with ``B * T == meta.num_nodes``
            (a packed forest is ``B = 1, T = N``). fp16/bf16/fp32.
        meta: the forest's :class:`ForestMeta` (``PackedForest.kernel_meta``), on q's device.
        g, beta: ``[B, T, H_v]`` gates; or raw ``a, b [B, T, H_v]`` with ``A_log, dt_bias [H_v]``
            (fused in the kernel).
        initial_state: fp32 state pool ``[S, H_v, d_k, d_v]``, only read; None for zeros.
        state_indices: ``[R]`` pool slot of each request (default ``arange(R)``); negative = zeros.
        snapshots: optional fp32 output buffer of ``N * H_v * d_k * d_v`` elements (reused across
            layers/rounds); allocated when None.
        check_values: also check finiteness, g <= 0 and index ranges (syncs with the device).
        block_v, num_warps, num_stages: launch configuration (default: the engines', see
            :func:`serial_default_config`).
        always_reload: reload the parent's snapshot at every non-root node, as SGLang's and
            vLLM's kernels do, instead of only when the parent is not the previous node.

    Returns ``(o, snapshots)``: ``o`` like ``v`` (padding rows zero); ``snapshots``
    ``[N, H_v, d_k, d_v]`` fp32, row i the state after node i (padding rows not written).
    """
    if not isinstance(meta, ForestMeta):
        raise TypeError(f"meta must be a ForestMeta (PackedForest.kernel_meta), got "
                        f"{type(meta).__name__}")
    o, snaps = _launch_serial(
        q, k, v, g, beta, a, b, A_log, dt_bias, initial_state, state_indices, scale,
        use_qk_l2norm_in_kernel, snapshots, check_values, meta.num_requests, meta.num_nodes,
        meta.cu_nodes, meta.parent_global, 0, block_v, num_warps, num_stages, always_reload,
        zero_output=True)
    return o, snaps


def chain_gdn_snapshots_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    g=None, beta=None, a=None, b=None, A_log=None, dt_bias=None,
    initial_state: torch.Tensor | None = None, state_indices: torch.Tensor | None = None,
    scale: float | None = None, use_qk_l2norm_in_kernel: bool = False,
    snapshots: torch.Tensor | None = None, check_values: bool = False,
    block_v: int | None = None, num_warps: int = 1, num_stages: int = 3,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``chain`` mode: ``B`` chains of ``T`` tokens each, one state snapshot per position.

    Same arguments as :func:`tree_gdn_serial_triton` without the forest (chain ``b`` is request
    ``b``, reading pool slot ``state_indices[b]``). Returns ``(o [B, T, H_v, d_v],
    snapshots [B, T, H_v, d_k, d_v])``; ``snapshots[b, t]`` is the state after position t, so the
    copy-commit of ``n`` accepted tokens of chain b copies node ``b * T + n - 1``.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        _validate(q, k, v, g, beta, a, b, A_log, dt_bias, initial_state, False)  # raises
    B, T = q.shape[:2]
    o, snaps = _launch_serial(
        q, k, v, g, beta, a, b, A_log, dt_bias, initial_state, state_indices, scale,
        use_qk_l2norm_in_kernel, snapshots, check_values, B, B * T, None, None, T,
        block_v, num_warps, num_stages, False, zero_output=False)
    return o, snaps.view(B, T, *snaps.shape[-3:])


@triton.jit(do_not_specialize=["R"])
def _copy_commit_kernel(
    snap, pool, state_indices, accepted,
    R,
    stride_snap_layer, stride_pool_layer, stride_pool_slot,
    STATE: tl.constexpr, BLOCK: tl.constexpr,
):
    i_lr, i_b = tl.program_id(0), tl.program_id(1)
    i_l = (i_lr // R).to(tl.int64)
    i_r = i_lr % R
    src = tl.load(accepted + i_r).to(tl.int64)
    dst = tl.load(state_indices + i_r).to(tl.int64)
    if (src >= 0) & (dst >= 0):
        offs = i_b * BLOCK + tl.arange(0, BLOCK)
        mask = offs < STATE
        x = tl.load(snap + i_l * stride_snap_layer + src * STATE + offs, mask=mask)
        tl.store(pool + i_l * stride_pool_layer + dst * stride_pool_slot + offs, x, mask=mask)


def commit_from_snapshots_triton(
    snapshots: torch.Tensor, state_pool: torch.Tensor, state_indices: torch.Tensor,
    accepted_global: torch.Tensor, *, block: int = 2048, num_warps: int = 4,
) -> torch.Tensor:
    """Copy-commit (``tree-serial`` and ``chain``): ``pool[slot_r] = snapshots[accepted_r]``.

    snapshots: ``[N, H_v, d_k, d_v]`` (or chain-shaped ``[B, T, H_v, d_k, d_v]``), or with a
    leading layer dim ``[Ly, N, ...]`` to commit every layer in one launch; state_pool:
    ``[S, H_v, d_k, d_v]`` or ``[Ly, S, H_v, d_k, d_v]``, written in place and returned;
    state_indices: ``[R]`` slots; accepted_global: ``[R]`` packed index of each request's accepted
    node (for a chain ``b * T + n_accepted - 1``). A negative slot or node skips that request.
    """
    pd = state_pool.dim()
    if pd not in (4, 5):
        raise ValueError(f"state_pool must be [S, H_v, d_k, d_v] or [Ly, S, H_v, d_k, d_v], got "
                         f"shape {tuple(state_pool.shape)}")
    pool = state_pool if pd == 5 else state_pool.unsqueeze(0)
    Ly = pool.shape[0]
    state_shape = tuple(pool.shape[2:])
    if snapshots.dim() == pd + 1 and pd == 4:       # chain-shaped [B, T, ...]
        snaps = snapshots.reshape(1, -1, *state_shape)
    elif snapshots.dim() == pd + 1 and pd == 5:     # [Ly, B, T, ...]
        snaps = snapshots.reshape(Ly, -1, *state_shape)
    elif snapshots.dim() == pd:
        snaps = snapshots if pd == 5 else snapshots.unsqueeze(0)
    else:
        raise ValueError(f"snapshots of shape {tuple(snapshots.shape)} do not fit a pool of shape "
                         f"{tuple(state_pool.shape)}")
    if snaps.shape[0] != Ly or tuple(snaps.shape[2:]) != state_shape:
        raise ValueError(f"snapshots of shape {tuple(snapshots.shape)} do not fit a pool of shape "
                         f"{tuple(state_pool.shape)}")
    if snaps.dtype != pool.dtype:
        raise TypeError(f"snapshots ({snaps.dtype}) and state_pool ({pool.dtype}) differ in dtype")
    H_v, d_k, d_v = state_shape
    if pool.stride()[2:] != (d_k * d_v, d_v, 1) or snaps.stride()[2:] != (d_k * d_v, d_v, 1):
        raise ValueError("snapshots and state_pool must be contiguous in [H_v, d_k, d_v]")
    if snaps.stride(1) != H_v * d_k * d_v:
        raise ValueError("snapshots must be contiguous over nodes")
    R = state_indices.shape[0]
    if state_indices.dim() != 1 or accepted_global.shape != (R,):
        raise ValueError(f"state_indices and accepted_global must both be [R], got "
                         f"{tuple(state_indices.shape)} and {tuple(accepted_global.shape)}")
    for name, x in (("snapshots", snapshots), ("state_indices", state_indices),
                    ("accepted_global", accepted_global)):
        if x.device != state_pool.device:
            raise ValueError(f"{name} is on {x.device} but state_pool is on {state_pool.device}")
    if R == 0:
        return state_pool
    STATE = H_v * d_k * d_v
    grid = (Ly * R, triton.cdiv(STATE, block))
    _copy_commit_kernel[grid](
        snaps, pool, state_indices.contiguous(), accepted_global.contiguous(), R,
        snaps.stride(0), pool.stride(0), pool.stride(1),
        STATE=STATE, BLOCK=block, num_warps=num_warps)
    return state_pool
