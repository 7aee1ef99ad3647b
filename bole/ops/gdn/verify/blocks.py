"""Building blocks of the tree-verification kernel (:mod:`bole.ops.gdn.verify.kernel`).

Each ``@triton.jit`` function here is one step of a program's work on one request's tree
(``BT`` node rows), one value head and one tile of ``BV`` value columns: locating the tree,
loading the gates and the ancestor mask, streaming ``d_k`` for the Gram and state products,
forming the decays, G and C, the Neumann solve, the output and the stores (padding rows
included). Triton inlines them into the kernel; none is launched on its own.

Notation as in docs/design.md section 2: ``L`` path log-decays, ``G`` (strict ancestors) and
``C`` (ancestors and self) the ``[BT, BT]`` tree matrices, ``R = beta (V - e^L K S_pre)``,
``(I + G) U = R``, ``O = e^L Q S_pre + C U``.
"""

import triton
import triton.language as tl


@triton.jit
def _pad_rows(o_ptr, u_ptr, L_ptr, kinv_ptr, k_ptr, s_kn, s_kh, p0, num_nodes, h, hk, vcols, v_ok,
              first_tile, H_V: tl.constexpr, H_K: tl.constexpr, GROUP: tl.constexpr,
              D_K: tl.constexpr, D_V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, L2NORM: tl.constexpr):
    """Padding rows ``p0 .. p0 + BT`` of this program's value tile: o = u = 0, L = 0 (once per head),
    and k_inv_norm of the padding keys (once per key head), so keys() is defined on every row.
    ``first_tile`` is a [BT] vector (all equal): whether this is the head's first value tile."""
    rows = tl.arange(0, BT)
    p_ok = (p0 + rows) < num_nodes
    base = p0.to(tl.int64)                                           # 64-bit scalar row base
    zero_tile = tl.zeros([BT, BV], dtype=tl.float32)
    _store_o_u(o_ptr, u_ptr, zero_tile, zero_tile, base, rows, h, vcols,
               p_ok[:, None] & v_ok[None, :], H_V, D_V)
    mask = p_ok & first_tile
    rk = tl.full([BT], 1.0, dtype=tl.float32)                        # not stored without L2NORM
    if L2NORM:
        w_ok = mask & ((rows * 0 + h % GROUP) == 0)                  # the rows whose norm is stored
        k_rows = k_ptr + base * s_kn + hk * s_kh
        ss = tl.zeros([BT], dtype=tl.float32)
        for k0 in range(0, D_K, BK):
            kc = k0 + tl.arange(0, BK)
            k_t = tl.load(k_rows + rows[:, None] * s_kn + kc[None, :],
                          mask=w_ok[:, None] & (kc < D_K)[None, :], other=0.0).to(tl.float32)
            ss += tl.sum(k_t * k_t, axis=1)
        rk = tl.rsqrt(ss + 1e-6)
    _store_node_factors(L_ptr, kinv_ptr, tl.zeros([BT], dtype=tl.float64), rk, base, rows, mask,
                        h, hk, H_V, H_K, GROUP, L2NORM)


@triton.jit
def _tree_rows(cu_ptr, r, BT: tl.constexpr):
    """Request r's tree: its first packed node (64-bit), its end (int32), the local rows
    ``0 .. BT`` and which of them are nodes of the tree."""
    lo32 = tl.load(cu_ptr + r)
    hi32 = tl.load(cu_ptr + r + 1)
    rows = tl.arange(0, BT)
    return lo32.to(tl.int64), hi32, rows, rows < hi32 - lo32


@triton.jit
def _pad_tail(o_ptr, u_ptr, L_ptr, kinv_ptr, k_ptr, s_kn, s_kh, p_start, num_nodes, h, hk, vcols,
              v_ok, first_tile, H_V: tl.constexpr, H_K: tl.constexpr, GROUP: tl.constexpr,
              D_K: tl.constexpr, D_V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, L2NORM: tl.constexpr, INTERPRET: tl.constexpr):
    """Every padding row from ``p_start`` (the end of the last tree) to ``num_nodes``, BT at a time."""
    if INTERPRET:
        # the interpreter needs a while loop over a runtime bound (see _neumann)
        p0 = p_start
        while p0 < num_nodes:
            _pad_rows(o_ptr, u_ptr, L_ptr, kinv_ptr, k_ptr, s_kn, s_kh, p0, num_nodes, h, hk, vcols,
                      v_ok, first_tile, H_V, H_K, GROUP, D_K, D_V, BT, BK, BV, L2NORM)
            p0 += BT
    else:
        for p0 in range(p_start, num_nodes, BT):
            _pad_rows(o_ptr, u_ptr, L_ptr, kinv_ptr, k_ptr, s_kn, s_kh, p0, num_nodes, h, hk, vcols,
                      v_ok, first_tile, H_V, H_K, GROUP, D_K, D_V, BT, BK, BV, L2NORM)


@triton.jit
def _store_o_u(o_ptr, u_ptr, O, U, lo, rows, h, vcols, out_mask, H_V: tl.constexpr, D_V: tl.constexpr):
    """One tree's ``[BT, BV]`` tiles of O (in o's dtype) and U (fp32) for value head h."""
    base = lo * (H_V * D_V)                                         # 64-bit scalar tree base
    out_off = rows[:, None] * (H_V * D_V) + h * D_V + vcols[None, :]   # 32-bit within the tree
    tl.store(o_ptr + base + out_off, O.to(o_ptr.dtype.element_ty), mask=out_mask)
    tl.store(u_ptr + base + out_off, U, mask=out_mask)


@triton.jit
def _store_node_factors(L_ptr, kinv_ptr, L, rk, lo, rows, mask, h, hk, H_V: tl.constexpr,
                        H_K: tl.constexpr, GROUP: tl.constexpr, L2NORM: tl.constexpr):
    """One tree's path log-decays L of value head h and, from the first value head of each key
    head only, the key inverse norms; ``mask`` a ``[BT]`` row vector (a scalar bool in a mask is
    refused by Triton >= 3.7's interpreter)."""
    tl.store(L_ptr + lo * H_V + rows * H_V + h, L, mask=mask)
    if L2NORM:
        tl.store(kinv_ptr + lo * H_K + rows * H_K + hk, rk, mask=mask & ((rows * 0 + h % GROUP) == 0))


@triton.jit
def _load_gate_columns(g_rows, b_rows, s_gn, s_bn, A_log_ptr, dt_bias_ptr, h, rows, row_ok,
                       RAW_GATES: tl.constexpr):
    """The per-node gate inputs of one tree and head as ``[BT, 1]`` fp32 columns (zero on padding
    rows): ``g`` and ``beta``, or the raw ``a, b`` with the head's ``A_log, dt_bias`` when
    RAW_GATES (else those two are 0). :func:`_gates` turns them into the gates."""
    col = rows[:, None] + tl.arange(0, 1)[None, :]                   # [BT, 1]
    ok = row_ok[:, None]
    g_col = tl.load(g_rows + col * s_gn, mask=ok, other=0.0).to(tl.float32)
    b_col = tl.load(b_rows + col * s_bn, mask=ok, other=0.0).to(tl.float32)
    if RAW_GATES:
        A_log = tl.load(A_log_ptr + h).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    else:
        A_log = 0.0
        dt_bias = 0.0
    return g_col, b_col, A_log, dt_bias


@triton.jit
def _gates(g_col, b_col, A_log, dt_bias, row_ok, RAW_GATES: tl.constexpr):
    """Per-node gates in fp32 from :func:`_load_gate_columns`, zero on padding rows: ``g`` (log
    decay) and ``beta``, fused from the raw ``a, b`` with ``A_log, dt_bias`` when RAW_GATES.

    The gates are computed as ``[BT, 1]`` columns and summed over the unit axis. That sum is exact
    (one term) and is there for the layout: a ``[BT]`` vector used in the ``[BT, BT]`` tiles takes
    their replicated slice layout, and Triton 3.6 then loads and computes every gate 16 times per
    thread (libdevice ``logf`` included); the reduction stops that propagation, so each thread
    computes one gate and the result is converted once.
    """
    ok = row_ok[:, None]
    if RAW_GATES:
        x = g_col + dt_bias
        # softplus(x) = max(x, 0) + log1p(exp(-|x|)), log1p by its series where 1 + t rounds to 1
        t = tl.exp(-tl.abs(x))
        log1p_t = tl.where(t < 1e-4, t * (1.0 - 0.5 * t), tl.log(1.0 + t))
        g = -tl.exp(A_log) * (tl.maximum(x, 0.0) + log1p_t)
        e_b = tl.exp(-tl.abs(b_col))                                  # sigmoid without overflow
        beta = tl.where(b_col >= 0, 1.0, e_b) / (1.0 + e_b)
    else:
        g = g_col
        beta = b_col
    g = tl.sum(tl.where(ok, g, 0.0), axis=1)
    beta = tl.sum(tl.where(ok, beta, 0.0), axis=1)
    return g, beta


@triton.jit
def _tree_matrices(kk, qk, ss_k, ss_q, strict, decay, beta, L, scale, BT: tl.constexpr,
                   L2NORM: tl.constexpr, COLS_IN_DECAY: tl.constexpr):
    """G (strict ancestors) and C (ancestors and self) from the Gram products, with the l2
    normalisation and the query scale as row / column scalings (the column scaling ``rk_j``
    already inside ``decay`` when COLS_IN_DECAY); also the key inverse norms and the row factors
    ``e^L rk`` of ``K S_pre`` and ``e^L rq`` of ``Q S_pre``."""
    # e^L inline rather than through a helper: a nested jit call changes ptxas's schedule
    e_L = tl.exp(L.to(tl.float32))
    if L2NORM:
        rk = tl.rsqrt(ss_k + 1e-6)                                   # k_inv_norm
        rq = tl.rsqrt(ss_q + 1e-6) * scale
    else:
        rk = tl.full([BT], 1.0, dtype=tl.float32)
        rq = tl.full([BT], 1.0, dtype=tl.float32) * scale
    if COLS_IN_DECAY:
        G = tl.where(strict, (beta * rk)[:, None] * decay * kk, 0.0)
        C = decay * qk * rq[:, None]
    elif L2NORM:
        G = tl.where(strict, (beta * rk)[:, None] * decay * kk * rk[None, :], 0.0)
        C = decay * qk * (rq[:, None] * rk[None, :])
    else:
        G = tl.where(strict, beta[:, None] * decay * kk, 0.0)
        C = decay * qk * scale
    return G, C, rk, e_L * rk, e_L * rq


@triton.jit
def _exp2_ftz(x, INTERPRET: tl.constexpr):
    """2^x in one MUFU.EX2 (``ex2.approx.ftz``: results below 2^-126 flush to zero). ``tl.exp``
    lowers to ``ex2.approx.f32`` after a multiply, and Triton 3.6's non-ftz form costs five
    instructions per element (a range test and a predicated rescale around the MUFU)."""
    if INTERPRET:
        return tl.exp2(x)
    else:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _load_ancestors(mask_rows, s_mn, rows, row_ok):
    """The tree's ancestor mask rows (self included), ``[BT, BT]`` uint8 as stored."""
    # rows past the tree may lie past the buffer; columns never do (the mask is [N, BT]), and a
    # set bit in a padding column is harmless (its key, gate and beta are zero), so the mask is
    # uniform along a row and the loads vectorise
    return tl.load(mask_rows + rows[:, None] * s_mn + rows[None, :], mask=row_ok[:, None], other=0)


@triton.jit
def _tree_decay(anc_u8, g, rows, col_log2, FUSED: tl.constexpr, INTERPRET: tl.constexpr,
                F32_L: tl.constexpr = False):
    """Ancestor mask (self included) from :func:`_load_ancestors`, strict mask, path log-decay L
    and the masked decay matrix.

    FUSED: ``decay_ij = 2^(L_i log2(e) - L_j log2(e) + col_log2_j)`` in one ftz exp2 per element,
    the exponent in fp64 (fp32 when F32_L: ``L`` then returns in fp32); ``col_log2`` (``[BT]``
    fp32) folds a column scaling (the key inverse norms) into the decays. Otherwise
    ``exp(L_i - L_j)`` and ``col_log2`` is not read."""
    anc = anc_u8 != 0
    strict = anc & (rows[:, None] != rows[None, :])
    # L_i = sum_j mask_ij g_j in fp64 (L_i - L_j of two long paths loses eps * |L| in fp32);
    # decays from the differences, masked to -inf *before* exp
    if F32_L:
        L = tl.sum(tl.where(anc, g[None, :], 0.0), axis=1)
    else:
        L = tl.sum(tl.where(anc, g.to(tl.float64)[None, :], 0.0), axis=1)
    if FUSED:
        L2 = L * 1.4426950408889634                                  # log2(e)
        if F32_L:
            diff = L2[:, None] - (L2 - col_log2)[None, :]
        else:
            diff = (L2[:, None] - (L2 - col_log2.to(tl.float64))[None, :]).to(tl.float32)
        decay = _exp2_ftz(tl.where(anc, diff, float("-inf")), INTERPRET)
    else:
        diff = (L[:, None] - L[None, :]).to(tl.float32)
        decay = tl.exp(tl.where(anc, diff, float("-inf")))
    return strict, L, decay


@triton.jit
def _dot(a, b, acc, PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """``tl.dot(a, b, acc, input_precision=PREC)``. Under Triton's interpreter, whose products of
    bf16 tiles are wrong (Triton 3.6 to 3.9), bf16 operands are widened to fp32 first (exact), so
    that the bf16 paths run on the CPU too; compiled, it is plain ``tl.dot``."""
    if INTERPRET and a.dtype == tl.bfloat16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _split_bf16(s):
    """fp32 ``s`` as ``s_hi + s_lo``, both bf16, round to nearest: ``|s - s_hi - s_lo| <= 2^-17 |s|``
    (16 mantissa bits against tf32's 10), so that bf16 ``x`` times s runs as two bf16 products."""
    s_hi = s.to(tl.bfloat16)
    s_lo = (s - s_hi.to(tl.float32)).to(tl.bfloat16)
    return s_hi, s_lo


@triton.jit
def _load_dk_tiles(x_base, k_base, s_base, k0, row_ok, vcols, v_ok, s_sk, s_sv,
                   D_K: tl.constexpr, D_V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   LOAD_X: tl.constexpr):
    """Step ``k0`` of the d_k loop: ``X``'s and K's ``[BT, BK]`` tiles (input dtype; X = K unless
    LOAD_X) and the S_pre tile ``[BK, BV]`` (fp32). Where BK divides d_k (and BV d_v) the column
    masks are left out: the q/k masks are then uniform along a row, so the loads vectorise, and
    the S_pre tile needs none (per-element masks cost address and predicate work every step)."""
    kc = k0 + tl.arange(0, BK)
    if D_K % BK == 0:
        k_t = tl.load(k_base + kc[None, :], mask=row_ok[:, None], other=0.0)
        x_t = k_t
        if LOAD_X:
            x_t = tl.load(x_base + kc[None, :], mask=row_ok[:, None], other=0.0)
        s_ptrs = s_base + kc[:, None] * s_sk + vcols[None, :] * s_sv
        if D_V % BV == 0:
            s_t = tl.load(s_ptrs)
        else:
            s_t = tl.load(s_ptrs, mask=v_ok[None, :], other=0.0)
    else:
        kc_ok = kc < D_K
        ld_mask = row_ok[:, None] & kc_ok[None, :]
        k_t = tl.load(k_base + kc[None, :], mask=ld_mask, other=0.0)
        x_t = k_t
        if LOAD_X:
            x_t = tl.load(x_base + kc[None, :], mask=ld_mask, other=0.0)
        s_t = tl.load(s_base + kc[:, None] * s_sk + vcols[None, :] * s_sv,
                      mask=kc_ok[:, None] & v_ok[None, :], other=0.0)
    return x_t, k_t, s_t


@triton.jit
def _state_products(x_t, s_t, xs, PREC: tl.constexpr, S_BF16X2: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """``xs + X S`` for one d_k step: S split into bf16 halves (two products) when S_BF16X2,
    else one product at PREC of X widened to fp32."""
    if S_BF16X2:
        s_hi, s_lo = _split_bf16(s_t)
        xs = _dot(x_t, s_hi, xs, PREC, INTERPRET)
        xs = _dot(x_t, s_lo, xs, PREC, INTERPRET)
    else:
        xs = tl.dot(x_t.to(tl.float32), s_t, xs, input_precision=PREC)
    return xs


@triton.jit
def _stream_state(q_base, k_base, s_base, row_ok, vcols, v_ok, s_sk, s_sv,
                  D_K: tl.constexpr, D_V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, PREC: tl.constexpr, S_BF16X2: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """One pass over d_k for the state products alone: ``K S`` and ``Q S`` [BT, BV]."""
    ks = tl.zeros([BT, BV], dtype=tl.float32)
    qs = tl.zeros([BT, BV], dtype=tl.float32)
    for k0 in range(0, D_K, BK):
        q_t, k_t, s_t = _load_dk_tiles(q_base, k_base, s_base, k0, row_ok, vcols, v_ok, s_sk, s_sv,
                                       D_K, D_V, BK, BV, True)
        ks = _state_products(k_t, s_t, ks, PREC, S_BF16X2, INTERPRET)
        qs = _state_products(q_t, s_t, qs, PREC, S_BF16X2, INTERPRET)
    return ks, qs


@triton.jit
def _output(C, U, row_qs, qs, PREC: tl.constexpr, CU_BF16X3: tl.constexpr,
            INTERPRET: tl.constexpr):
    """``O = e^L Q S_pre + C U`` (l2 normalisation and scale applied as row / column scalings):
    ``C U`` as three bf16 products of hi/lo halves when CU_BF16X3 (16 mantissa bits against
    tf32's 10), else one product at PREC."""
    if CU_BF16X3:
        c_hi, c_lo = _split_bf16(C)
        u_hi, u_lo = _split_bf16(U)
        O = _dot(c_hi, u_hi, row_qs[:, None] * qs, PREC, INTERPRET)
        O = _dot(c_hi, u_lo, O, PREC, INTERPRET)
        O = _dot(c_lo, u_hi, O, PREC, INTERPRET)
    else:
        O = row_qs[:, None] * qs + tl.dot(C, U, input_precision=PREC)
    return O


@triton.jit
def _stream_dk(x_base, k_base, s_base, row_ok, vcols, v_ok, s_sk, s_sv,
               D_K: tl.constexpr, D_V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, X_IS_K: tl.constexpr, PREC: tl.constexpr, S_BF16X2: tl.constexpr,
               INTERPRET: tl.constexpr):
    """One pass over d_k: ``X K^T`` [BT, BT], ``X S`` [BT, BV] and the row sums of squares of X."""
    xk = tl.zeros([BT, BT], dtype=tl.float32)
    xs = tl.zeros([BT, BV], dtype=tl.float32)
    ss = tl.zeros([BT], dtype=tl.float32)
    for k0 in range(0, D_K, BK):
        x_t, k_t, s_t = _load_dk_tiles(x_base, k_base, s_base, k0, row_ok, vcols, v_ok, s_sk, s_sv,
                                       D_K, D_V, BK, BV, not X_IS_K)
        xk = _dot(x_t, tl.trans(k_t), xk, PREC, INTERPRET)
        xs = _state_products(x_t, s_t, xs, PREC, S_BF16X2, INTERPRET)
        x_f = x_t.to(tl.float32)
        ss += tl.sum(x_f * x_f, axis=1)
    return xk, xs, ss


@triton.jit
def _pow2_scale(Rm):
    """Powers of two ``(s, 1 / s)`` with ``max |Rm| * s`` in ``[0.5, 1)`` (``s`` from the exponent
    bits of ``max |Rm|``, so scaling by it is exact); ``s = 2^126`` when ``Rm`` is zero."""
    m = tl.max(tl.max(tl.abs(Rm), axis=1), axis=0)
    e = (m.to(tl.int32, bitcast=True) >> 23) & 0xFF                 # biased exponent, 0..254
    e = tl.minimum(tl.maximum(e, 1), 252)
    s = ((253 - e) << 23).to(tl.float32, bitcast=True)               # 2^(126 - e)
    s_inv = ((e + 1) << 23).to(tl.float32, bitcast=True)             # 2^(e - 126)
    return s, s_inv


@triton.jit
def _sweep_product(G, U, PREC: tl.constexpr, F16: tl.constexpr):
    """``G U`` of one sweep: fp16 operands (G already fp16) when F16, else ``PREC``."""
    if F16:
        return tl.dot(G, U.to(tl.float16))
    else:
        return tl.dot(G, U, input_precision=PREC)


@triton.jit
def _neumann(G, Rm, max_depth, PREC: tl.constexpr, F16: tl.constexpr, TRANS: tl.constexpr,
             INTERPRET: tl.constexpr):
    """``(I + G) U = R`` for G nilpotent of index <= max_depth + 1: max_depth sweeps are exact.

    TRANS (with F16 only): sweep the transposed system, ``U^T = R^T - U^T G^T``: the iterate is
    then the product's first operand, which the tensor cores take from registers, so a sweep
    needs no shared-memory store of U and no barrier (G^T, the constant operand, is stored once).

    F16: the products ``G U`` in fp16 (twice tf32's tensor-core rate; operands rounded to
    nearest with tf32's 10 mantissa bits, where tf32 truncates fp32 operands), fp32 accumulation
    and fp32 U. Only for ``|G_ij| <= 1`` (l2-normalised keys, beta <= 1, decays <= 1) and
    ``max_depth <= 15``: R is scaled by a power of two to ``max |R| < 1``, and every iterate then
    stays under ``2^max_depth <= 2^15`` (fp16's largest finite value is 65504): row i of ``G^m R``
    is bounded by the number of ancestor chains of length m ending at i, ``C(depth_i, m)``."""
    if F16:
        s, s_inv = _pow2_scale(Rm)
        Rm = Rm * s
        G = G.to(tl.float16)
    if TRANS:
        U = _neumann_transposed(tl.trans(G), tl.trans(Rm), max_depth, INTERPRET)
        U = tl.trans(U)
    else:
        U = _neumann_sweeps(G, Rm, max_depth, PREC, F16, INTERPRET)
    if F16:
        U = U * s_inv
    return U


@triton.jit
def _neumann_sweeps(G, Rm, max_depth, PREC: tl.constexpr, F16: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """max_depth sweeps ``U <- R - G U`` from ``U = R`` (operands as _neumann prepared them)."""
    U = Rm
    if INTERPRET:
        # Triton 3.6's interpreter cannot use a scalar argument as a range() bound under
        # numpy >= 2.4 (int() of a 1-element array); a while loop only needs bool().
        sweep = 0
        while sweep < max_depth:
            U = Rm - _sweep_product(G, U, PREC, F16)
            sweep += 1
    elif max_depth > 0:
        # the first sweep is peeled so that G's conversion to the dot-operand layout happens
        # before the loop and CSE reuses it in there; in the plain loop Triton 3.6 redoes the
        # conversion (shuffles and selects) in every sweep
        U = Rm - _sweep_product(G, Rm, PREC, F16)
        for _ in range(1, max_depth):
            U = Rm - _sweep_product(G, U, PREC, F16)
    return U


@triton.jit
def _neumann_transposed(Gt, Rt, max_depth, INTERPRET: tl.constexpr):
    """max_depth sweeps ``U^T <- R^T - U^T G^T`` from ``U^T = R^T``: ``Rt`` [BV, BT] fp32, ``Gt``
    [BT, BT] fp16; the products in fp16 with fp32 accumulation."""
    Ut = Rt
    if INTERPRET:
        sweep = 0
        while sweep < max_depth:
            Ut = Rt - tl.dot(Ut.to(tl.float16), Gt)
            sweep += 1
    elif max_depth > 0:
        Ut = Rt - tl.dot(Rt.to(tl.float16), Gt)
        for _ in range(1, max_depth):
            Ut = Rt - tl.dot(Ut.to(tl.float16), Gt)
    return Ut


