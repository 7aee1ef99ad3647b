"""Per-head q/k RMSNorm + partial rotary embedding of the attention layers, fused: one Triton
launch for q or k (``qk_norm_rope``), for both (``qk_norm_rope_pair``), or for both with k and v
written straight into KV pool rows (``qk_norm_rope_to_pool``); the torch reference spells out the
model's unfused code. Shares the checks and dispatch of :mod:`bole.ops.fused` (``impl``: "auto",
"torch", "triton"); launches depend only on shapes, so they can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from bole.ops.fused import _check, _num_warps, _rms_norm_ref, _row_tile, _use_triton
from bole.ops.triton_utils import fix_interpreter_scalar_index, interpreting

__all__ = ["qk_norm_rope", "qk_norm_rope_pair", "qk_norm_rope_to_pool"]

fix_interpreter_scalar_index()


# ---- kernels ----

@triton.jit
def _norm_rope_rows(x, w, pos, inv_freq, out, n, h, heads, D, sxn, sxh, eps,
                    ROT: tl.constexpr, BLOCK_D: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Heads ``h [BLOCK_H]`` of token n: per-head RMSNorm, then rope on dims < ROT; head h goes
    to ``out + h * D`` (out: the token's output row)."""
    HALF: tl.constexpr = ROT // 2
    d = tl.arange(0, BLOCK_D)
    mask_d = d < D
    m = (h < heads)[:, None] & mask_d[None, :]
    dt = out.dtype.element_ty
    row = x + n * sxn + h.to(tl.int64)[:, None] * sxh
    xv = tl.load(row + d[None, :], mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xv * xv, 1) / D + eps)[:, None]
    y = xv * rstd * (1.0 + tl.load(w + d, mask=mask_d, other=0.0).to(tl.float32))
    y = y.to(dt).to(tl.float32)                                      # the norm's output
    # rotate_half's partner of each rotary dim (normalised the same way), negated in the first half
    in_rot = d < ROT
    first = d < HALF
    pd = tl.where(in_rot, tl.where(first, d + HALF, d - HALF), d)
    xp = tl.load(row + pd[None, :], mask=m, other=0.0).to(tl.float32)
    yp = xp * rstd * (1.0 + tl.load(w + pd, mask=mask_d, other=0.0).to(tl.float32))
    yp = tl.where(first[None, :], -1.0, 1.0) * yp.to(dt).to(tl.float32)
    # angles exactly as positions.float() * inv_freq; cos/sin rounded to x's dtype
    ang = tl.load(pos + n).to(tl.float32) * tl.load(inv_freq + d % HALF, mask=in_rot, other=0.0)
    if LIBDEVICE:       # full-range accurate cos/sin (the compiled tl.cos may be an approximation)
        c, s = libdevice.cos(ang), libdevice.sin(ang)
    else:
        c, s = tl.cos(ang), tl.sin(ang)
    c, s = c.to(dt).to(tl.float32)[None, :], s.to(dt).to(tl.float32)[None, :]
    # each product and the sum rounded to x's dtype, as torch's rot * cos + rotate_half(rot) * sin
    rotated = (y * c).to(dt).to(tl.float32) + (yp * s).to(dt).to(tl.float32)
    res = tl.where(in_rot[None, :], rotated, y)
    tl.store(out + h.to(tl.int64)[:, None] * D + d[None, :], res.to(dt), mask=m)


@triton.jit
def _qk_norm_rope_kernel(x, w, pos, inv_freq, out, heads, D, sxn, sxh, eps, n_hblocks,
                         ROT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                         LIBDEVICE: tl.constexpr):
    """One program per (token, BLOCK_H heads)."""
    pid = tl.program_id(0)
    n, h = (pid // n_hblocks).to(tl.int64), (pid % n_hblocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    _norm_rope_rows(x, w, pos, inv_freq, out + n * heads * D, n, h, heads, D, sxn, sxh, eps, ROT,
                    BLOCK_D, LIBDEVICE)


@triton.jit(do_not_specialize=["T", "M"])
def _qk_pair_kernel(q, wq, qo, hq, sqn, sqh, nqb, k, wk, ko, hk, skn, skh, nkb, pos, inv_freq,
                    D, eps, v, svn, svh, k_pool, v_pool, slots, ctx, rows, T, s_ps, s_pm, M,
                    ROT: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
                    BLOCK_D: tl.constexpr, LIBDEVICE: tl.constexpr, POOL: tl.constexpr,
                    ROWS_GIVEN: tl.constexpr):
    """Programs ``[0, N * nqb)`` take q's heads, the rest k's: both in one launch. With POOL,
    k's heads (and v's) go to pool row ``(slots[n // T], rows[n] or ctx[n // T] + n % T)``
    instead of ``ko``; rows outside ``[0, M)`` are not written."""
    pid = tl.program_id(0)
    per = nqb + nkb
    n, b = (pid // per).to(tl.int64), pid % per
    if b < nqb:
        _norm_rope_rows(q, wq, pos, inv_freq, qo + n * hq * D, n, b * BQ + tl.arange(0, BQ), hq,
                        D, sqn, sqh, eps, ROT, BLOCK_D, LIBDEVICE)
    else:
        h = (b - nqb) * BK + tl.arange(0, BK)
        if POOL:
            r = n // T
            if ROWS_GIVEN:
                row = tl.load(rows + n).to(tl.int64)
            else:
                row = tl.load(ctx + r).to(tl.int64) + n % T
            heads = tl.where((row >= 0) & (row < M), hk, 0)    # nothing to write off the pool
            base = tl.load(slots + r).to(tl.int64) * s_ps + row * s_pm
            _norm_rope_rows(k, wk, pos, inv_freq, k_pool + base, n, h, heads, D, skn, skh, eps,
                            ROT, BLOCK_D, LIBDEVICE)
            d = tl.arange(0, BLOCK_D)
            m = (h < heads)[:, None] & (d < D)[None, :]
            vals = tl.load(v + n * svn + h.to(tl.int64)[:, None] * svh + d[None, :], mask=m)
            tl.store(v_pool + base + h.to(tl.int64)[:, None] * D + d[None, :], vals, mask=m)
        else:
            _norm_rope_rows(k, wk, pos, inv_freq, ko + n * hk * D, n, h, hk, D, skn, skh, eps,
                            ROT, BLOCK_D, LIBDEVICE)


# ---- torch reference (the model's unfused code) ----

def _rope_ref(x, positions, inv_freq, rotary_dim) -> torch.Tensor:
    freqs = positions.to(x.device, torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    return torch.cat((rot * cos + torch.cat((-x2, x1), dim=-1) * sin, rest), dim=-1)


# ---- public ops ----

def qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor,
                 inv_freq: torch.Tensor, rotary_dim: int, eps: float, *,
                 impl: str = "auto") -> torch.Tensor:
    """Per-head zero-centred RMSNorm of q or k, then rotary embedding of the first rotary_dim dims.

    x: ``[N, heads, hd]`` (strided views allowed, last dim contiguous); weight ``[hd]``; positions
    ``[N]`` integers; inv_freq ``[rotary_dim / 2]`` fp32 (angles ``positions.float() * inv_freq``,
    their cos / sin rounded to x's dtype, as HybridModel._rope). Returns ``[N, heads, hd]``
    contiguous in x's dtype.
    """
    what = "qk_norm_rope"
    _check_rope(what, x, weight, positions, inv_freq, rotary_dim)
    N, heads, hd = x.shape
    if not _use_triton(impl, what, x, weight):
        return _rope_ref(_rms_norm_ref(x, weight, eps), positions, inv_freq, rotary_dim)
    out = torch.empty((N, heads, hd), dtype=x.dtype, device=x.device)
    per, block = _row_tile(what, heads, hd)
    n_hblocks = triton.cdiv(heads, per)
    if N and heads:
        _qk_norm_rope_kernel[(N * n_hblocks,)](
            x, weight.contiguous(), positions.contiguous(), inv_freq.contiguous(), out, heads, hd,
            x.stride(0), x.stride(1), float(eps), n_hblocks, ROT=rotary_dim, BLOCK_H=per,
            BLOCK_D=block, LIBDEVICE=not interpreting(), num_warps=_num_warps(per * block))
    return out


def qk_norm_rope_pair(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                      k_weight: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                      rotary_dim: int, eps: float, *,
                      impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`qk_norm_rope` of q ``[N, Hq, hd]`` and k ``[N, Hkv, hd]`` (each with its own
    weight) in one launch; the values of two calls, to rounding (the launch's warp count may
    sum a head's squares in another order)."""
    if not _pair_kernel(impl, q, k, q_weight, k_weight):
        return (qk_norm_rope(q, q_weight, positions, inv_freq, rotary_dim, eps, impl=impl),
                qk_norm_rope(k, k_weight, positions, inv_freq, rotary_dim, eps, impl=impl))
    return _launch_pair(q, k, q_weight, k_weight, positions, inv_freq, rotary_dim, eps)


def qk_norm_rope_to_pool(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         q_weight: torch.Tensor, k_weight: torch.Tensor, positions: torch.Tensor,
                         inv_freq: torch.Tensor, rotary_dim: int, eps: float,
                         k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                         ctx_lens: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                         *, impl: str = "auto") -> torch.Tensor:
    """:func:`qk_norm_rope_pair` with the normed, rotated keys and the values ``v [N, Hkv, hd]``
    written straight into the pools ``[S, M, Hkv, hd]`` (one launch, no k output).

    Token ``n`` of request ``r = n // T`` (``T = N // len(slots)``) goes to row
    ``(slots[r], rows[n])``, or ``(slots[r], ctx_lens[r] + n % T)`` without ``rows`` (the tree's
    scratch rows, as :func:`bole.ops.attention.write_kv`). The caller keeps rows inside the pool
    (the kernel skips any outside it; the torch path raises). Returns q ``[N, Hq, hd]``."""
    from bole.ops.attention import write_kv
    if (rows is None) == (ctx_lens is None):
        raise ValueError("qk_norm_rope_to_pool takes either ctx_lens or rows")
    N, R = q.shape[0], slots.shape[0]
    if R == 0 or N % R:
        raise ValueError(f"{N} tokens are not a multiple of the {R} slots")
    pool_ok = (k_pool.dtype == v_pool.dtype == k.dtype == v.dtype and k_pool.shape == v_pool.shape
               and k_pool.dim() == 4 and tuple(k_pool.shape[2:]) == tuple(k.shape[1:])
               and k_pool.stride()[2:] == (k.shape[2], 1) and v_pool.stride() == k_pool.stride()
               and v.shape == k.shape and v.stride(2) == 1)
    if not (pool_ok and _pair_kernel(impl, q, k, q_weight, k_weight)):
        qo, ko = qk_norm_rope_pair(q, k, q_weight, k_weight, positions, inv_freq, rotary_dim, eps,
                                   impl=impl)
        if rows is None:
            write_kv(k_pool, v_pool, ko, v, slots, ctx_lens)
        else:
            index = (slots.long().repeat_interleave(N // R), rows.reshape(-1).long())
            k_pool[index] = ko.to(k_pool.dtype)
            v_pool[index] = v.to(v_pool.dtype)
        return qo
    return _launch_pair(q, k, q_weight, k_weight, positions, inv_freq, rotary_dim, eps,
                        pool=(v, k_pool, v_pool, slots, ctx_lens, rows))[0]


def _pair_kernel(impl: str, q, k, q_weight, k_weight) -> bool:
    return _use_triton(impl, "qk_norm_rope_pair", q, k, q_weight, k_weight) and \
        q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2] and q.dtype == k.dtype


def _check_rope(what: str, x, weight, positions, inv_freq, rotary_dim, name: str = "x") -> None:
    """The arguments of a q/k norm + rope: ``x [N, heads, head_dim]`` and its weight, the rotary
    width, ``positions [N]`` and fp32 ``inv_freq [rotary_dim / 2]``."""
    _check(what, name, x, (None, None, None), "[N, heads, head_dim]", rows=True)
    N, _, hd = x.shape
    if not isinstance(rotary_dim, int) or rotary_dim < 2 or rotary_dim % 2 or rotary_dim > hd:
        raise ValueError(f"{what}: rotary_dim must be an even int in [2, head_dim={hd}], "
                         f"got {rotary_dim!r}")
    _check(what, "weight" if name == "x" else f"{name}_weight", weight, (hd,), "[head_dim]",
           device=x.device)
    _check(what, "positions", positions, (N,), "[N]", kind="int", device=x.device)
    _check(what, "inv_freq", inv_freq, (rotary_dim // 2,), "[rotary_dim / 2]", device=x.device)
    if inv_freq.dtype != torch.float32:
        raise TypeError(f"{what}: inv_freq must be fp32, got {inv_freq.dtype}")


def _launch_pair(q, k, q_weight, k_weight, positions, inv_freq, rotary_dim, eps, pool=None):
    what = "qk_norm_rope"
    _check_rope(what, q, q_weight, positions, inv_freq, rotary_dim, "q")
    _check_rope(what, k, k_weight, positions, inv_freq, rotary_dim, "k")
    N, Hq, hd = q.shape
    Hkv = k.shape[1]
    qo = torch.empty((N, Hq, hd), dtype=q.dtype, device=q.device)
    if pool is None:
        ko = torch.empty((N, Hkv, hd), dtype=k.dtype, device=k.device)
        v = k_pool = v_pool = slots = ctx = rows = ko         # unused
        svn = svh = s_ps = s_pm = M = 0
        T = 1
    else:
        v, k_pool, v_pool, slots, ctx, rows = pool
        ko = None
        T = N // slots.shape[0]
        svn, svh = v.stride(0), v.stride(1)
        s_ps, s_pm, M = k_pool.stride(0), k_pool.stride(1), k_pool.shape[1]
        ctx = slots if ctx is None else ctx.contiguous()
        rows = slots if rows is None else rows.reshape(-1).contiguous()
    bq, block = _row_tile(what, Hq, hd)
    bk, _ = _row_tile(what, Hkv, hd)
    nqb, nkb = triton.cdiv(Hq, bq), triton.cdiv(Hkv, bk)
    if N and Hq and Hkv:
        _qk_pair_kernel[(N * (nqb + nkb),)](
            q, q_weight.contiguous(), qo, Hq, q.stride(0), q.stride(1), nqb,
            k, k_weight.contiguous(), ko if ko is not None else qo, Hkv, k.stride(0), k.stride(1),
            nkb, positions.contiguous(), inv_freq.contiguous(), hd, float(eps),
            v, svn, svh, k_pool, v_pool, slots, ctx, rows, T, s_ps, s_pm, M,
            ROT=rotary_dim, BQ=bq, BK=bk, BLOCK_D=block, LIBDEVICE=not interpreting(),
            POOL=pool is not None, ROWS_GIVEN=pool is not None and pool[5] is not None,
            num_warps=_num_warps(max(bq, bk) * block))
    return qo, ko
