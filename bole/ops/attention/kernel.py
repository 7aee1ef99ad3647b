"""Tree attention in Triton (split-context, a merge of the splits' partials), its launch, and
prefill attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention.bias import causal_lower_right

from bole.ops.attention.checks import _check_gate, _check_pools, _check_query, _check_tree
from bole.ops.attention.reference import _apply_gate, _tree_attention_torch
from bole.ops.triton_utils import check_kernel_device, fix_interpreter_scalar_index

__all__ = ["LOG2E", "TARGET_PROGRAMS", "MIN_SPLIT_KEYS", "default_num_splits", "tree_attention",
           "prefill_attention"]

fix_interpreter_scalar_index()          # the kernel loops up to the loaded context length

LOG2E = 1.4426950408889634
#: Programs a launch should have for long contexts (the H200 has 132 SMs).
TARGET_PROGRAMS = 128
#: Fewest committed positions a context split covers, so that a split runs several key blocks.
MIN_SPLIT_KEYS = 256


@triton.jit
def _attend_block(acc, m_i, l_i, q, k_base, v_base, pos, key_ok, visible, s_km, s_vm, d, d_ok,
                  qk_scale, IEEE: tl.constexpr):
    """One online-softmax step over the keys at ``pos [BLOCK_N]``; ``visible`` broadcasts to
    ``[BM, BLOCK_N]``. Running max ``m_i`` is in log2 units; a row with nothing visible so far keeps
    ``m_i = -inf``, ``l_i = 0`` and ``acc = 0``."""
    kt = tl.load(k_base + pos[None, :] * s_km + d[:, None],
                 mask=key_ok[None, :] & d_ok[:, None], other=0.0)             # [BD, BLOCK_N]
    if IEEE:
        s = tl.dot(q, kt, input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    s = tl.where(visible, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)   # avoids -inf - -inf for empty rows
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + pos[:, None] * s_vm + d[None, :],
                mask=key_ok[:, None] & d_ok[None, :], other=0.0)              # [BLOCK_N, BD]
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return acc * alpha[:, None] + pv, m_new, l_i


@triton.jit
def _finish(o_ptr, gate_ptr, acc, l_i, n, h, d, row_ok, d_ok, s_gn, s_gh,
            HQ: tl.constexpr, D: tl.constexpr, HAS_GATE: tl.constexpr):
    """Normalise ``acc [BM, BD]`` by ``l_i``, cast to the output dtype, gate, and store rows
    ``(n, h)`` of ``o [N, HQ, D]``. A row with ``l_i == 0`` saw nothing and has ``acc == 0``."""
    o = (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]).to(o_ptr.dtype.element_ty)
    omask = row_ok[:, None] & d_ok[None, :]
    if HAS_GATE:      # torch's (o.to(dtype) * sigmoid(gate)): both factors rounded to the dtype
        g = tl.load(gate_ptr + n[:, None] * s_gn + h[:, None] * s_gh + d[None, :], mask=omask,
                    other=0.0)
        sg = tl.sigmoid(g.to(tl.float32)).to(o_ptr.dtype.element_ty)
        o = (o.to(tl.float32) * sg.to(tl.float32)).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + (n[:, None] * HQ + h[:, None]) * D + d[None, :], o, mask=omask)


@triton.jit(do_not_specialize=["N", "Tq", "Tk", "M_ctx", "chunk", "NQB"])
def _tree_attn_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, ctx_ptr, mask_ptr, gate_ptr, o_ptr,
                      po_ptr, pml_ptr, s_qn, s_qh, s_ks, s_km, s_kh, s_vs, s_vm, s_vh, s_mn, s_mj,
                      s_gn, s_gh, N, Tq, Tk, M_ctx, chunk, NQB, qk_scale,
                      HQ: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                      BQ: tl.constexpr, GP: tl.constexpr, BD: tl.constexpr, BLOCK_N: tl.constexpr,
                      SPLIT: tl.constexpr, HAS_GATE: tl.constexpr, IEEE: tl.constexpr):
    """Program (request r, kv head, node block; split s): rows = BQ nodes x GP heads of the group.

    Split s covers committed positions ``[s * chunk, min((s + 1) * chunk, ctx))``; the last split
    also takes the Tk scratch keys under ``tree_mask``. With SPLIT the unnormalised partial
    ``(acc, m, l)`` goes to the workspace, else the finished (gated) output to ``o``.
    """
    pid = tl.program_id(0)
    split = tl.program_id(1)
    qb = pid % NQB
    hkv = (pid // NQB) % HKV
    r = pid // (NQB * HKV)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    ctx = tl.minimum(tl.maximum(tl.load(ctx_ptr + r).to(tl.int32), 0), M_ctx)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, ctx)
    is_last = split == tl.num_programs(1) - 1
    scratch_hi = tl.where(is_last, Tk, 0)
    busy = (hi > lo) | is_last      # an idle program loads nothing and writes an empty partial

    i = tl.arange(0, BQ * GP)
    node = qb * BQ + i // GP
    g = i % GP
    row_ok = (node < Tq) & (g < GROUP)
    n = r * Tq + node
    h = hkv * GROUP + g
    d = tl.arange(0, BD)
    d_ok = d < D
    # (a scalar bool & a vector bool is int32 under the interpreter: compare with a bound instead)
    q_ok = (node < tl.where(busy, Tq, 0)) & (g < GROUP)
    q = tl.load(q_ptr + n[:, None] * s_qn + h[:, None] * s_qh + d[None, :],
                mask=q_ok[:, None] & d_ok[None, :], other=0.0)                # [BM, BD]
    k_base = k_ptr + slot * s_ks + hkv * s_kh
    v_base = v_ptr + slot * s_vs + hkv * s_vh

    m_i = tl.full([BQ * GP], float("-inf"), tl.float32)
    l_i = tl.zeros([BQ * GP], tl.float32)
    acc = tl.zeros([BQ * GP, BD], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):                  # committed keys: all visible
        pos = start + cols
        ok = pos < hi
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_base, v_base, pos, ok, ok[None, :],
                                      s_km, s_vm, d, d_ok, qk_scale, IEEE)
    for j0 in range(0, scratch_hi, BLOCK_N):              # scratch keys: the node's tree mask
        j = j0 + cols
        j_ok = j < Tk
        vis = tl.load(mask_ptr + n[:, None] * s_mn + j[None, :] * s_mj,
                      mask=row_ok[:, None] & j_ok[None, :], other=0) != 0
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_base, v_base, ctx + j, j_ok, vis,
                                      s_km, s_vm, d, d_ok, qk_scale, IEEE)

    if SPLIT:
        row = split * N * HQ + n * HQ + h                 # into the workspace [splits, N, HQ]
        tl.store(po_ptr + row[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(pml_ptr + row * 2, m_i, mask=row_ok)
        tl.store(pml_ptr + row * 2 + 1, l_i, mask=row_ok)
    else:
        _finish(o_ptr, gate_ptr, acc, l_i, n, h, d, row_ok, d_ok, s_gn, s_gh, HQ, D, HAS_GATE)


@triton.jit(do_not_specialize=["NH"])
def _merge_kernel(po_ptr, pml_ptr, gate_ptr, o_ptr, NH, s_gn, s_gh, NUM_SPLITS: tl.constexpr,
                  HQ: tl.constexpr, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
                  HAS_GATE: tl.constexpr):
    """Merge the splits' partials of BR rows ``n * HQ + h``: weights ``exp2(m_s - max m)``."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = rows < NH
    d = tl.arange(0, BD)
    d_ok = d < D
    m_max = tl.full([BR], float("-inf"), tl.float32)
    for s in range(NUM_SPLITS):
        m_max = tl.maximum(m_max, tl.load(pml_ptr + (s * NH + rows) * 2, mask=ok, other=float("-inf")))
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    acc = tl.zeros([BR, BD], tl.float32)
    l_i = tl.zeros([BR], tl.float32)
    for s in range(NUM_SPLITS):
        row = s * NH + rows
        w = tl.exp2(tl.load(pml_ptr + row * 2, mask=ok, other=float("-inf")) - m_use)
        l_i += w * tl.load(pml_ptr + row * 2 + 1, mask=ok, other=0.0)
        part = tl.load(po_ptr + row[:, None] * D + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        acc += w[:, None] * part
    _finish(o_ptr, gate_ptr, acc, l_i, rows // HQ, rows % HQ, d, ok, d_ok, s_gn, s_gh, HQ, D,
            HAS_GATE)


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _interpreting() -> bool:
    """Whether the kernels were wrapped for Triton's interpreter (TRITON_INTERPRET at import)."""
    return type(_tree_attn_kernel).__name__ == "InterpretedFunction"


def _tile(Tq: int, group: int, D: int) -> dict:
    """Block sizes: ``BQ`` nodes x ``GP`` (group rounded up to a power of two) rows per program,
    16 to 128 rows (tl.dot needs 16); ``BD`` head-dim columns; ``BLOCK_N`` keys per step.
    Warps and stages were measured on the H200 (8 warps only pay at 128 rows)."""
    BD, GP = max(16, _next_pow2(D)), _next_pow2(group)
    max_rows = 16 if _interpreting() else 128
    BQ = max(min(_next_pow2(Tq), max(1, max_rows // GP)), max(1, 16 // GP))
    if _interpreting():
        return dict(BQ=BQ, GP=GP, BD=BD, BLOCK_N=16, num_warps=1, num_stages=1)
    big = BQ * GP >= 128
    return dict(BQ=BQ, GP=GP, BD=BD, BLOCK_N=64 if BD <= 128 else 32,
                num_warps=8 if big else 4, num_stages=3 if big or BD <= 128 else 2)


def default_num_splits(R: int, Hkv: int, q_blocks: int, M_ctx: int) -> int:
    """Context splits of a launch: 1 when ``R * Hkv * q_blocks`` programs already reach
    ``TARGET_PROGRAMS``; else enough splits to reach it, but no more than leave each split
    ``MIN_SPLIT_KEYS`` of the ``M_ctx = M - Tk`` committed positions a slot can hold."""
    programs = R * Hkv * q_blocks
    if programs >= TARGET_PROGRAMS:
        return 1
    return max(1, min(triton.cdiv(TARGET_PROGRAMS, programs), M_ctx // MIN_SPLIT_KEYS))


def _tree_attention_triton(q, k_pool, v_pool, slots, ctx_lens, tree_mask, scale, gate,
                           num_splits, R, Tq, Tk):
    N, Hq, D = q.shape
    M, Hkv = k_pool.shape[1], k_pool.shape[2]
    if k_pool.stride(3) != 1 or v_pool.stride(3) != 1:
        raise ValueError("k_pool and v_pool need a contiguous last (head-dim) axis")
    q = q if q.stride(2) == 1 else q.contiguous()
    if gate is not None:                  # read as [N, Hq, D] with any row and head strides
        gate = gate.reshape(N, Hq, D)
        gate = gate if gate.stride(2) == 1 else gate.contiguous()
    mask = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask
    tile = _tile(Tq, Hq // Hkv, D)
    nqb = triton.cdiv(Tq, tile["BQ"])
    M_ctx = M - Tk
    splits = default_num_splits(R, Hkv, nqb, M_ctx) if num_splits is None else int(num_splits)
    if splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    # whole key blocks per split (a ragged block costs as much as a full one)
    chunk = max(1, triton.cdiv(triton.cdiv(M_ctx, splits), tile["BLOCK_N"])) * tile["BLOCK_N"]
    o = torch.empty(N, Hq, D, dtype=q.dtype, device=q.device)
    if splits > 1:     # workspace: unnormalised outputs and (max, sum) per split and row
        part_o = torch.empty(splits, N, Hq, D, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(splits, N, Hq, 2, dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = o                                   # unused
    g_arg = q if gate is None else gate
    s_gn, s_gh = (0, 0) if gate is None else gate.stride()[:2]
    _tree_attn_kernel[(R * Hkv * nqb, splits)](
        q, k_pool, v_pool, slots, ctx_lens, mask, g_arg, o, part_o, part_ml,
        q.stride(0), q.stride(1), *k_pool.stride()[:3], *v_pool.stride()[:3],
        mask.stride(0), mask.stride(1), s_gn, s_gh, N, Tq, Tk, M_ctx, chunk, nqb, scale * LOG2E,
        HQ=Hq, HKV=Hkv, GROUP=Hq // Hkv, D=D, SPLIT=splits > 1, HAS_GATE=gate is not None,
        IEEE=q.dtype == torch.float32, **tile)
    if splits > 1:
        BR = 16
        _merge_kernel[(triton.cdiv(N * Hq, BR),)](
            part_o, part_ml, g_arg, o, N * Hq, s_gn, s_gh, NUM_SPLITS=splits, HQ=Hq, D=D, BR=BR,
            BD=tile["BD"], HAS_GATE=gate is not None, num_warps=1 if _interpreting() else 4)
    return o


def tree_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   slots: torch.Tensor, ctx_lens: torch.Tensor, tree_mask: torch.Tensor, *,
                   scale: float, gate: torch.Tensor | None = None, num_splits: int | None = None,
                   impl: str = "auto") -> torch.Tensor:
    """Tree attention of ``q [N, Hq, D]`` (N = R * Tq; a strided view with a contiguous last axis
    is fine) over ``k_pool, v_pool [S, M, Hkv, D]``: node n of request r sees the committed
    positions ``0 .. ctx_lens[r]-1`` of slot ``slots[r]`` and scratch key j (position
    ``ctx_lens[r] + j``) iff ``tree_mask[n, j]`` (``[N, Tk]`` bool/uint8). fp32 softmax of
    ``scale * q.k``; rows that see nothing give zeros. ``gate [N, Hq * D]`` applies the sigmoid
    output gate. Returns ``o [N, Hq, D]`` in q's dtype.

    impl: "triton" (the split-context kernel; CUDA, or CPU under TRITON_INTERPRET=1), "torch"
    (one batched softmax over the slots' M positions) or "auto" (Triton on CUDA, else torch).
    num_splits: context splits of the Triton launch (default :func:`default_num_splits`); with
    more than one, a workspace of ``num_splits * N * Hq * (D + 2)`` fp32 holds the partials.
    """
    R, Tq, Tk = _check_tree(q, k_pool, v_pool, slots, ctx_lens, tree_mask, gate)
    if q.dtype == torch.float64:
        raise TypeError("tree_attention takes fp16/bf16/fp32 tensors (fp64 is the reference's)")
    if impl == "auto":
        impl = "triton" if q.is_cuda else "torch"
    if impl == "torch":
        o = _tree_attention_torch(q, k_pool, v_pool, slots, ctx_lens, tree_mask, scale, R, Tq)
        return _apply_gate(o.to(q.dtype), gate)
    if impl != "triton":
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    check_kernel_device(q.device, "tree_attention(impl='triton')")
    return _tree_attention_triton(q, k_pool, v_pool, slots, ctx_lens, tree_mask, scale, gate,
                                  num_splits, R, Tq, Tk)


def prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slot: int,
                      ctx_len: int, *, scale: float, gate: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of one request's prompt chunk ``q [P, Hq, D]`` whose keys already sit at
    positions ``ctx_len .. ctx_len+P-1`` of slot ``slot`` (host ints: prefill runs eagerly).
    Token i sees positions ``<= ctx_len + i`` (a causal mask aligned to the bottom right).

    SDPA with ``causal_lower_right``, so the GPU runs the flash kernel (fp16/bf16, native GQA)
    or, for fp32, the memory-efficient one (kv heads expanded: it has no GQA); memory stays linear
    in the context. Returns ``[P, Hq, D]`` in q's dtype, gated like :func:`tree_attention`.
    """
    _check_pools(k_pool, v_pool)
    _check_query(q, k_pool)
    _check_gate(gate, q)
    S, M, Hkv, _ = k_pool.shape
    P, Hq = q.shape[0], q.shape[1]
    for name, x in (("slot", slot), ("ctx_len", ctx_len)):
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name} must be a Python int, got {type(x).__name__}")
    if not 0 <= slot < S:
        raise ValueError(f"slot {slot} is outside the pool's {S} slots")
    if P < 1 or ctx_len < 0 or ctx_len + P > M:
        raise ValueError(f"ctx_len {ctx_len} + P {P} tokens must fit the slot's {M} positions")
    L = ctx_len + P
    keys = k_pool[slot, :L].transpose(0, 1)[None]                            # [1, Hkv, L, D]
    vals = v_pool[slot, :L].transpose(0, 1)[None]
    gqa = Hq != Hkv
    if gqa and q.is_cuda and q.dtype == torch.float32:      # memory-efficient kernel: no GQA
        keys = keys.repeat_interleave(Hq // Hkv, dim=1)
        vals = vals.repeat_interleave(Hq // Hkv, dim=1)
        gqa = False
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, vals,
                                       attn_mask=causal_lower_right(P, L), scale=scale,
                                       enable_gqa=gqa)                        # [1, Hq, P, D]
    return _apply_gate(o[0].transpose(0, 1).to(q.dtype), gate)
