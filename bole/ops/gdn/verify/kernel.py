"""Value-tiled Triton kernel for exact GDN tree verification (docs/design.md section 2).

One program holds one request's whole draft tree for one value head and one tile of ``BV`` value
columns; grid = ``(d_v / BV, R, H_v)`` (``(1, R, H_v)`` with ``whole_head``: each program then
takes its head's value tiles in turn). With ``A(i)`` the strict ancestors of node i and
``L_i = sum of g over A(i) + {i}``, each program computes

    decay_ij = exp(where(j in A(i) + {i}, L_i - L_j, -inf))          (masked *before* exp)
    G = beta_i decay_ij (k_i . k_j) on strict ancestors,   C = decay_ij (q_i . k_j) incl. self
    R = beta (V - e^L K S_pre),   (I + G) U = R   by  U <- R - G U  (max_depth sweeps)
    O = e^L Q S_pre + C U

streaming ``d_k`` in tiles of ``BK`` for the Gram products ``K K^T``, ``Q K^T`` and the state
products ``K S_pre``, ``Q S_pre`` (the S_pre tile ``[BK, BV]`` read from the state pool at slot
``state_indices[r]``). l2 normalisation and the query scale are applied afterwards as row/column
scalings of these products, so the keys are never rewritten. The state pool is only read; the
program writes O and U (and, once per head, L and the key inverse norms). 64-bit offsets sit in
scalar per-tree bases; per-element offsets within a tree stay 32-bit. Padding rows past
``cu_nodes[-1]`` are written (zeros) by the last request's programs, so no output needs a memset.

Each value tile recomputes the ``[BT, BT]`` Gram products of its tree: the price of ``d_v / BV``
times more parallelism, which small batches need; ``whole_head`` drops it where the batch fills
the GPU without it. Inputs may be fp16/bf16/fp32; gates, state and accumulation are fp32.
``precision`` selects tl.dot's ``input_precision`` for fp32 operands ("tf32", "tf32x3" or
"ieee"). In "tf32" the table's launches replace tf32 (whose fp32 operands the tensor cores
truncate) wherever it cost accuracy or time: split bf16 state products, ``C U`` in three bf16
products and fp16 sweeps (:class:`~bole.ops.gdn.verify.configs.VerifyConfig`).

The steps are in :mod:`bole.ops.gdn.verify.blocks`, the launch configurations in
:mod:`bole.ops.gdn.verify.configs` (re-exported here). This module knows nothing of models or
requests beyond :class:`bole.tree.ForestMeta`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bole.ops.gdn.closed_form import TreeFactors
from bole.ops.gdn.verify.arguments import checked_arguments
from bole.ops.gdn.verify.blocks import (
    _dot, _gates, _load_ancestors, _load_dk_tiles, _load_gate_columns, _neumann, _output,
    _pad_tail, _state_products, _store_node_factors, _store_o_u, _stream_dk, _stream_state,
    _tree_decay, _tree_matrices, _tree_rows)
from bole.ops.gdn.verify.configs import (  # noqa: F401  (re-exported: the kernel's public names)
    CONFIG_TABLE, F16_SWEEP_MAX_DEPTH, INTERPRET_CONFIG, MIN_PROGRAMS, NARROW_TILE, ONE_WAVE,
    ONE_WAVE_PROGRAMS, PRECISIONS, WAVE_SLOTS, WHOLE_HEAD_COST, VerifyConfig,
    _refuse_known_miscompile, _whole_head_pays, device_sms, kernel_switches, pick_config)
from bole.ops.triton_utils import interpreting
from bole.tree import ForestMeta

try:                                    # in Triton 3.6 and 3.9; a Triton without it never raises it
    from triton.runtime.errors import PTXASError
except ImportError:                     # pragma: no cover
    class PTXASError(Exception):
        """Stand-in that nothing raises."""
try:
    from triton.runtime.errors import OutOfResources
except ImportError:                     # pragma: no cover
    class OutOfResources(Exception):
        """Stand-in that nothing raises."""

__all__ = [
    "VerifyConfig", "CONFIG_TABLE", "NARROW_TILE", "INTERPRET_CONFIG", "PRECISIONS", "pick_config",
    "kernel_switches", "tree_gdn_verify_triton",
]


def _interpreting() -> bool:
    """Whether the kernel runs under Triton's CPU interpreter.

    Decided by how ``@triton.jit`` wrapped the kernel (TRITON_INTERPRET as it was at import time),
    so a later change of the environment variable cannot desynchronise the two.
    """
    kernel = globals().get("_tree_gdn_verify_kernel")
    if kernel is not None:
        return type(kernel).__name__ == "InterpretedFunction"
    return interpreting()


# the sizes vary round to round: specialising on them (== 1, % 16) would compile a variant each
@triton.jit(do_not_specialize=["num_nodes", "num_requests", "max_depth"])
def _tree_gdn_verify_kernel(
    q_ptr, k_ptr, v_ptr,
    g_ptr, beta_ptr,                # g, beta  -- or the raw a, b when RAW_GATES
    A_log_ptr, dt_bias_ptr,         # [H_v], only read when RAW_GATES
    state_ptr, state_idx_ptr,       # state pool [S, H_v, d_k, d_v] fp32 (strided), slots [R]
    cu_ptr, mask_ptr,               # cu_nodes [R + 1] int32, ancestor mask [N, BT] uint8
    o_ptr, u_ptr, L_ptr, kinv_ptr,  # o [N, H_v, d_v] (v's dtype), u [N, H_v, d_v] fp32,
                                    # L [N, H_v] fp32, k_inv_norm [N, H_k] fp32
    num_nodes, num_requests, max_depth, scale,
    s_qn, s_qh, s_kn, s_kh, s_vn, s_vh,
    s_gn, s_gh, s_bn, s_bh,
    s_ss, s_sh, s_sk, s_sv,
    s_mn,
    H_V: tl.constexpr, H_K: tl.constexpr, GROUP: tl.constexpr,
    D_K: tl.constexpr, D_V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SPLIT: tl.constexpr,
    RAW_GATES: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr, S_BF16X2: tl.constexpr,
    CU_BF16X3: tl.constexpr, FUSED_NORMS: tl.constexpr, F16_SWEEPS: tl.constexpr,
    DEFER_GATES: tl.constexpr, PREFETCH: tl.constexpr, T_SWEEPS: tl.constexpr,
    WHOLE_HEAD: tl.constexpr, EARLY_DECAY: tl.constexpr, DECAY_IN_LOOP: tl.constexpr,
    DECAY_STEP: tl.constexpr, F32_L: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    iv = tl.program_id(0)
    r = tl.program_id(1)
    h = tl.program_id(2)
    hk = h // GROUP

    lo, hi32, rows, row_ok = _tree_rows(cu_ptr, r, BT)
    # 64-bit offsets live in the scalar per-tree bases; per-element offsets (< BT rows) stay 32-bit
    gate_in = _load_gate_columns(g_ptr + lo * s_gn + h * s_gh, beta_ptr + lo * s_bn + h * s_bh,
                                 s_gn, s_bn, A_log_ptr, dt_bias_ptr, h, rows, row_ok, RAW_GATES)
    if not (DEFER_GATES or DECAY_IN_LOOP):
        g, beta = _gates(*gate_in, row_ok, RAW_GATES)

    vcols = iv * BV + tl.arange(0, BV)
    v_ok = vcols < D_V
    slot = tl.load(state_idx_ptr + r).to(tl.int64)
    s_base = state_ptr + slot * s_ss + h.to(tl.int64) * s_sh
    q_base = q_ptr + lo * s_qn + hk * s_qh + rows[:, None] * s_qn
    k_base = k_ptr + lo * s_kn + hk * s_kh + rows[:, None] * s_kn
    mask_rows = mask_ptr + lo * s_mn
    v_rows = v_ptr + lo * s_vn + h * s_vh + rows[:, None] * s_vn

    if SPLIT:
        # Two passes over d_k: K first (G, R, then U), Q second (C, O), so that at most one
        # [BT, BT] Gram accumulator is live at a time; K and S_pre are read twice (from L2).
        kk, ks, ss_k = _stream_dk(k_base, k_base, s_base, row_ok, vcols, v_ok, s_sk, s_sv,
                                  D_K, D_V, BT, BK, BV, True, PREC, S_BF16X2, INTERPRET)
        strict, L, decay = _tree_decay(_load_ancestors(mask_rows, s_mn, rows, row_ok), g, rows, beta,
                                        False, INTERPRET)
        e_L = tl.exp(L.to(tl.float32))
        if L2NORM:
            rk = tl.rsqrt(ss_k + 1e-6)                               # k_inv_norm
            G = tl.where(strict, (beta * rk)[:, None] * decay * kk * rk[None, :], 0.0)
            row_ks = e_L * rk
        else:
            rk = tl.full([BT], 1.0, dtype=tl.float32)
            G = tl.where(strict, beta[:, None] * decay * kk, 0.0)
            row_ks = e_L
        v_t = tl.load(v_rows + vcols[None, :], mask=row_ok[:, None] & v_ok[None, :],
                      other=0.0).to(tl.float32)
        U = _neumann(G, beta[:, None] * (v_t - row_ks[:, None] * ks), max_depth, PREC,
                     F16_SWEEPS, T_SWEEPS, INTERPRET)
        qk, qs, ss_q = _stream_dk(q_base, k_base, s_base, row_ok, vcols, v_ok, s_sk, s_sv,
                                  D_K, D_V, BT, BK, BV, False, PREC, S_BF16X2, INTERPRET)
        strict, L, decay = _tree_decay(_load_ancestors(mask_rows, s_mn, rows, row_ok), g, rows, beta,
                                        False, INTERPRET)
        if L2NORM:
            rq = tl.rsqrt(ss_q + 1e-6) * scale
            C = decay * qk * (rq[:, None] * rk[None, :])
        else:
            rq = tl.full([BT], 1.0, dtype=tl.float32) * scale
            C = decay * qk * scale
        row_qs = e_L * rq
    else:
        # One pass over d_k accumulating both Gram products and both state products.
        kk = tl.zeros([BT, BT], dtype=tl.float32)
        qk = tl.zeros([BT, BT], dtype=tl.float32)
        ks = tl.zeros([BT, BV], dtype=tl.float32)
        qs = tl.zeros([BT, BV], dtype=tl.float32)
        ss_k = tl.zeros([BT], dtype=tl.float32)
        ss_q = tl.zeros([BT], dtype=tl.float32)
        if PREFETCH or EARLY_DECAY:
            # issued before the loop so that their latency hides behind it (registers permitting)
            anc_u8 = _load_ancestors(mask_rows, s_mn, rows, row_ok)
        if PREFETCH:
            v_in = tl.load(v_rows + vcols[None, :], mask=row_ok[:, None] & v_ok[None, :], other=0.0)
        if EARLY_DECAY:
            # the decays need only the gates and the mask (Triton 3.6 issues the loop's first
            # loads after them); the key norms' column scaling is applied after the loop, and a
            # decay of a non-ancestor is 0, so the mask is not needed again (only the diagonal is
            # taken out of G). DECAY_IN_LOOP: in the loop's step DECAY_STEP (the first, after
            # its first loads, or the last, which Triton peels off the loop)
            if DECAY_IN_LOOP:
                beta = tl.zeros([BT], dtype=tl.float32)
                L = tl.zeros([BT], dtype=tl.float32 if F32_L else tl.float64)
                decay = tl.zeros([BT, BT], dtype=tl.float32)
            else:
                _, L, decay = _tree_decay(anc_u8, g, rows, tl.zeros([BT], dtype=tl.float32), True,
                                          INTERPRET, F32_L)
        for k0 in range(0, D_K, BK):
            if DECAY_IN_LOOP:
                if k0 == DECAY_STEP * BK:
                    g, beta = _gates(*gate_in, row_ok, RAW_GATES)
                    _, L, decay = _tree_decay(anc_u8, g, rows, tl.zeros([BT], dtype=tl.float32),
                                              True, INTERPRET, F32_L)
            q_t, k_t, s_t = _load_dk_tiles(q_base, k_base, s_base, k0, row_ok, vcols, v_ok, s_sk,
                                           s_sv, D_K, D_V, BK, BV, True)
            kt_t = tl.trans(k_t)
            kk = _dot(k_t, kt_t, kk, PREC, INTERPRET)
            qk = _dot(q_t, kt_t, qk, PREC, INTERPRET)
            ks = _state_products(k_t, s_t, ks, PREC, S_BF16X2, INTERPRET)
            qs = _state_products(q_t, s_t, qs, PREC, S_BF16X2, INTERPRET)
            k_f = k_t.to(tl.float32)
            q_f = q_t.to(tl.float32)
            if L2NORM:
                if not FUSED_NORMS:
                    ss_k += tl.sum(k_f * k_f, axis=1)
                ss_q += tl.sum(q_f * q_f, axis=1)
        # unless PREFETCH, the ancestor mask and V are loaded after the loop so that no other
        # tile is live in it; G and C are formed at once so that kk, qk and decay die before the
        # solve. DEFER_GATES: the gates computed only now from inputs loaded at the start, so
        # that the prologue's loads are not held up behind the gate loads' latency.
        if DEFER_GATES:
            g, beta = _gates(*gate_in, row_ok, RAW_GATES)
        if not (PREFETCH or EARLY_DECAY):
            anc_u8 = _load_ancestors(mask_rows, s_mn, rows, row_ok)
        if FUSED_NORMS and L2NORM:
            # |k_i|^2 from the diagonal of K K^T (the same products, accumulated by the tensor
            # cores)
            ss_k = tl.sum(tl.where(rows[:, None] == rows[None, :], kk, 0.0), axis=1)
        if EARLY_DECAY:
            strict = rows[:, None] != rows[None, :]
        elif FUSED_NORMS:
            # the column scaling rk_j of G and C folded into the decays' exponent
            if L2NORM:
                col_log2 = tl.log2(tl.rsqrt(ss_k + 1e-6))        # log2 of _tree_matrices' rk
            else:
                col_log2 = tl.zeros([BT], dtype=tl.float32)
            strict, L, decay = _tree_decay(anc_u8, g, rows, col_log2, True, INTERPRET, F32_L)
        else:
            strict, L, decay = _tree_decay(anc_u8, g, rows, beta, False, INTERPRET)
        G, C, rk, row_ks, row_qs = _tree_matrices(kk, qk, ss_k, ss_q, strict, decay, beta, L, scale,
                                                  BT, L2NORM, FUSED_NORMS and not EARLY_DECAY)
        if not PREFETCH:
            v_in = tl.load(v_rows + vcols[None, :], mask=row_ok[:, None] & v_ok[None, :], other=0.0)
        if WHOLE_HEAD and F16_SWEEPS:
            G = G.to(tl.float16)          # kept for the head's other tiles: half the registers
        U = _neumann(G, beta[:, None] * (v_in.to(tl.float32) - row_ks[:, None] * ks), max_depth,
                     PREC, F16_SWEEPS, T_SWEEPS, INTERPRET)

    O = _output(C, U, row_qs, qs, PREC, CU_BF16X3, INTERPRET)

    # ---- write O, U (and L, k_inv_norm once per head) ----
    _store_o_u(o_ptr, u_ptr, O, U, lo, rows, h, vcols, row_ok[:, None] & v_ok[None, :], H_V, D_V)
    # masks as row vectors (Triton >= 3.7's interpreter refuses a scalar bool in a mask)
    first_tile = (rows * 0 + iv) == 0                    # [BT], all equal
    _store_node_factors(L_ptr, kinv_ptr, L, rk, lo, rows, row_ok & first_tile, h, hk,
                        H_V, H_K, GROUP, L2NORM)

    # ---- padding rows (past cu_nodes[-1]) are written by the last request's programs ----
    if r == num_requests - 1:
        _pad_tail(o_ptr, u_ptr, L_ptr, kinv_ptr, k_ptr, s_kn, s_kh, hi32, num_nodes, h, hk, vcols,
                  v_ok, first_tile, H_V, H_K, GROUP, D_K, D_V, BT, BK, BV, L2NORM, INTERPRET)

    if WHOLE_HEAD:
        # ---- the head's other value tiles, reusing G, C and the row scalings ----
        not_first = rows < 0                             # [BT], all False: L, k_inv_norm are done
        for t in range(1, (D_V + BV - 1) // BV):
            vcols = t * BV + tl.arange(0, BV)
            v_ok = vcols < D_V
            v_in = tl.load(v_rows + vcols[None, :], mask=row_ok[:, None] & v_ok[None, :], other=0.0)
            ks, qs = _stream_state(q_base, k_base, s_base, row_ok, vcols, v_ok, s_sk, s_sv,
                                   D_K, D_V, BT, BK, BV, PREC, S_BF16X2, INTERPRET)
            U = _neumann(G, beta[:, None] * (v_in.to(tl.float32) - row_ks[:, None] * ks),
                         max_depth, PREC, F16_SWEEPS, T_SWEEPS, INTERPRET)
            O = _output(C, U, row_qs, qs, PREC, CU_BF16X3, INTERPRET)
            _store_o_u(o_ptr, u_ptr, O, U, lo, rows, h, vcols, row_ok[:, None] & v_ok[None, :],
                       H_V, D_V)
            if r == num_requests - 1:
                _pad_tail(o_ptr, u_ptr, L_ptr, kinv_ptr, k_ptr, s_kn, s_kh, hi32, num_nodes, h,
                          hk, vcols, v_ok, not_first, H_V, H_K, GROUP, D_K, D_V, BT, BK, BV,
                          L2NORM, INTERPRET)



def _rows(x: torch.Tensor, n: int, *tail: int) -> torch.Tensor:
    """``x`` reshaped to ``[n, *tail]`` (a view where possible) with unit stride in the last dim."""
    y = x.reshape(n, *tail)
    if y.stride(-1) != 1 and y.shape[-1] > 1:
        y = y.contiguous()
    return y


def _checked_factors_out(f: TreeFactors, N: int, H_k: int, H_v: int, d_v: int, device,
                         l2norm: bool):
    """``(u, log_decay, k_inv_norm)`` of ``factors_out``, checked against what the kernel
    writes (contiguous, on the device, of the shapes and dtypes it returns)."""
    want = {"u": ((N, H_v, d_v), torch.float32), "log_decay": ((N, H_v), torch.float64)}
    if l2norm:
        want["k_inv_norm"] = ((N, H_k), torch.float32)
    for name, (shape, dtype) in want.items():
        t = getattr(f, name)
        if (t is None or tuple(t.shape) != shape or t.dtype != dtype or t.device != device
                or not t.is_contiguous()):
            got = None if t is None else (t.dtype, tuple(t.shape), str(t.device),
                                          t.is_contiguous())
            raise ValueError(f"factors_out.{name} must be a contiguous {dtype} {list(shape)} on "
                             f"{device}, got {got}")
    return f.u, f.log_decay, (f.k_inv_norm if l2norm else None)


def _factors(factors_out: TreeFactors | None, N: int, H_k: int, H_v: int, d_v: int, device,
             l2norm: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Where the kernel writes ``u [N, H_v, d_v]`` fp32, ``log_decay [N, H_v]`` fp64 and
    ``k_inv_norm [N, H_k]`` fp32 (None without the in-kernel l2 norm): ``factors_out``'s tensors,
    checked, or new ones."""
    if factors_out is not None:
        return _checked_factors_out(factors_out, N, H_k, H_v, d_v, device, l2norm)
    u = torch.empty(N, H_v, d_v, dtype=torch.float32, device=device)
    log_decay = torch.empty(N, H_v, dtype=torch.float64, device=device)
    k_inv_norm = torch.empty(N, H_k, dtype=torch.float32, device=device) if l2norm else None
    return u, log_decay, k_inv_norm


def _gate_inputs(g, beta, a, b, A_log, dt_bias, N: int, H_v: int):
    """The kernel's gate inputs ``[N, H_v]``: ``(g, beta)``, or the raw ``(a, b)`` with
    ``A_log``, ``dt_bias`` (contiguous) when ``g`` is None (then the kernel computes the gates)."""
    raw_gates = g is None
    gate1, gate2 = (a, b) if raw_gates else (g, beta)
    gate1 = gate1.reshape(N, H_v)
    gate2 = gate2.reshape(N, H_v)
    if raw_gates:
        return gate1, gate2, A_log.contiguous(), dt_bias.contiguous()
    return gate1, gate2, gate1, gate1             # A_log, dt_bias never read


def _switches(config: VerifyConfig, dtype: torch.dtype, precision: str, raw_gates: bool,
              l2norm: bool, meta: ForestMeta, d_k: int, d_v: int) -> tuple[dict, int]:
    """The kernel's compile-time switches for ``config`` (refusing a known miscompile), and its
    value tiles per head."""
    switches = kernel_switches(config, dtype=dtype, precision=precision, raw_gates=raw_gates,
                               l2norm=l2norm, max_depth=int(meta.max_depth),
                               interpret=_interpreting(), d_k=d_k)
    _refuse_known_miscompile(config, switches, meta.block_nodes, dtype, precision)
    value_tiles = 1 if switches["WHOLE_HEAD"] else triton.cdiv(d_v, config.BV)
    return switches, value_tiles


def _compile_error(exc: Exception, config: VerifyConfig, BT: int) -> Exception:
    """What a failed compile of ``config`` at ``BT`` node slots says to the caller (a ptxas
    error under a register cap, or a configuration that does not fit the GPU)."""
    if isinstance(exc, PTXASError):
        # e.g. Triton 3.6 at BT = 256: one wgmma's accumulator alone needs ~154 registers
        said = next((ln.strip() for ln in str(exc).splitlines() if "ptxas fatal" in ln),
                    "no reason given")
        return ValueError(
            f"ptxas could not compile the verification kernel for {config} at "
            f"block_nodes={BT} under maxnreg={config.maxnreg}; raise maxnreg or leave it "
            f"None (ptxas: {said[:240]})")
    # raised before the launch: the outputs are new and the pool is only read
    return ValueError(
        f"the verification kernel for {config} does not fit this GPU at "
        f"block_nodes={BT} ({exc}); use fewer num_stages, a smaller BV or BK, "
        f"split_gram=True for trees over 128 nodes, or config=None for pick_config's "
        f"choice")


def tree_gdn_verify_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: ForestMeta, *,
    g=None, beta=None, a=None, b=None, A_log=None, dt_bias=None,
    initial_state: torch.Tensor, state_indices: torch.Tensor | None = None,
    scale: float | None = None, use_qk_l2norm_in_kernel: bool = False,
    precision: str | None = None, check_values: bool = False, config: VerifyConfig | None = None,
    out_dtype: torch.dtype | None = None, factors_out: TreeFactors | None = None,
) -> tuple[torch.Tensor, TreeFactors]:
    """Verify every node of a packed forest in one launch.

    Args:
        q, k: ``[B, T, H_k, d_k]``; v: ``[B, T, H_v, d_v]`` (fp16, bf16 or fp32), ``B * T == N``.
        meta: :meth:`PackedForest.kernel_meta` on the inputs' device.
        g, beta: ``[B, T, H_v]`` gates, or raw ``a, b [B, T, H_v]`` with ``A_log, dt_bias [H_v]``
            (gates then computed in the kernel, in fp32).
        initial_state: state pool ``[S, H_v, d_k, d_v]`` fp32, only read.
        state_indices: ``[R]`` integer slot of each request in the pool; default ``arange(R)``
            (then ``S`` must equal ``R``), built on the device at every call: one more launch
            (about 1 us on the H200), so a caller that runs many layers passes its slots.
        scale: query scale, default ``d_k ** -0.5``.
        precision: tl.dot input precision for fp32 operands: "tf32", "tf32x3" or "ieee". Default:
            "tf32" for fp16/bf16 inputs (an fp32 O within about 1e-5 of fp64), "ieee" for fp32
            inputs, whose Gram products would also be rounded to tf32 (errors up to 4e-2 at
            d = 128); ask for "tf32" explicitly only where that is acceptable.
        check_values: also check for NaN/inf, positive g and out-of-range slots (syncs the device).
        config: override of :func:`pick_config`'s choice (benchmark sweeps).
        out_dtype: dtype of ``o`` (fp16, bf16 or fp32), default v's dtype. fp32 keeps the kernel's
            own accuracy: a bf16 ``o`` carries bf16's rounding (~1.7e-3 relative) on top of it.
        factors_out: where to write ``u``, ``log_decay`` and ``k_inv_norm`` (contiguous tensors of
            the returned shapes and dtypes, e.g. one layer's slices of buffers stacked over
            layers, so that the cross-layer commit needs no copy); ``k`` is ignored.

    Returns ``(o, factors)``: ``o`` shaped like ``v`` in ``out_dtype``; ``factors`` with
    ``log_decay [N, H_v]`` fp64, ``k`` the raw keys ``[N, H_k, d_k]`` (a view), ``u [N, H_v, d_v]``
    fp32 and ``k_inv_norm [N, H_k]`` fp32 when ``use_qk_l2norm_in_kernel`` (else None).
    Padding nodes get ``o = 0``, ``u = 0``, ``log_decay = 0``; their ``k_inv_norm`` is the true
    inverse norm of their keys, so ``factors.keys()`` is the normalised keys on every row.
    """
    precision, (B, T, H_k, d_k, H_v, d_v), state_indices = checked_arguments(
        q, k, v, meta, g, beta, a, b, A_log, dt_bias, initial_state, state_indices, precision,
        out_dtype, check_values)
    raw_gates, l2norm = g is None, bool(use_qk_l2norm_in_kernel)
    N, R, BT = meta.num_nodes, meta.num_requests, meta.block_nodes
    if config is None:
        config = pick_config(BT, d_k, d_v, R * H_v, interpret=_interpreting())
    config.validate()
    scale = float(d_k ** -0.5 if scale is None else scale)
    qf = _rows(q, N, H_k, d_k)
    k_raw = k.reshape(N, H_k, d_k)
    kf = k_raw if k_raw.stride(-1) == 1 or d_k == 1 else k_raw.contiguous()
    vf = _rows(v, N, H_v, d_v)
    gate1, gate2, A_log_t, dt_bias_t = _gate_inputs(g, beta, a, b, A_log, dt_bias, N, H_v)
    o = torch.empty(v.shape, dtype=v.dtype if out_dtype is None else out_dtype, device=q.device)
    u, log_decay, k_inv_norm = _factors(factors_out, N, H_k, H_v, d_v, q.device, l2norm)
    kinv_arg = k_inv_norm if k_inv_norm is not None else log_decay       # never written then
    if N > 0 and R > 0:
        switches, value_tiles = _switches(config, q.dtype, precision, raw_gates, l2norm, meta,
                                          d_k, d_v)
        try:
            _tree_gdn_verify_kernel[(value_tiles, R, H_v)](
                qf, kf, vf, gate1, gate2, A_log_t, dt_bias_t,
                initial_state, state_indices, meta.cu_nodes, meta.ancestor_mask,
                o, u, log_decay, kinv_arg,
                N, R, int(meta.max_depth), scale,
                qf.stride(0), qf.stride(1), kf.stride(0), kf.stride(1), vf.stride(0), vf.stride(1),
                gate1.stride(0), gate1.stride(1), gate2.stride(0), gate2.stride(1),
                *initial_state.stride(),
                meta.ancestor_mask.stride(0),
                H_V=H_v, H_K=H_k, GROUP=H_v // H_k, D_K=d_k, D_V=d_v, BT=BT, BK=config.BK,
                BV=config.BV, RAW_GATES=raw_gates, L2NORM=l2norm,
                PREC=precision, **switches,
                num_warps=config.num_warps, num_stages=config.num_stages,
                **({"maxnreg": config.maxnreg} if config.maxnreg and not switches["INTERPRET"]
                   else {}))
        except (PTXASError, OutOfResources) as exc:
            if isinstance(exc, PTXASError) and not config.maxnreg:
                raise
            raise _compile_error(exc, config, BT) from exc
    return o, TreeFactors(log_decay=log_decay, k=k_raw, u=u, k_inv_norm=k_inv_norm)
