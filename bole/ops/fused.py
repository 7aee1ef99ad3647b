"""Fused per-token ops of the hybrid layers: one Triton launch each, with bit-exact torch references.

    add_rms_norm      s = x + residual, zero-centred RMSNorm s / rms(s) * (1 + w)
    embed_norm_pair   the MTP head's fc input: [norm(embed[tokens]) | norm(prev hidden)]
    gated_rms_norm    GDN output norm w * x / rms(x) * silu(z)
    silu_mul          silu(gate) * up of the fused gate|up projection rows
    qk_norm_rope      per-head zero-centred RMSNorm of q or k, then partial rotary embedding
                      (qk_norm_rope_pair: q and k in one launch; qk_norm_rope_to_pool: k and v
                      written straight into KV pool rows): bole/ops/rope.py, on this module's checks
    tree_conv1d_pool  depthwise causal conv + SiLU of a draft forest, conv state read from the pool

Each torch reference spells out the layers' unfused torch code op for op (the same roundings, bit
for bit; tests/ops/test_fused.py pins them to it, and tree_conv1d_pool to bole.ops.conv);
each kernel rounds to the storage dtype at the same points but reduces in fp32 in its own order, so
it matches to rounding. ``impl``: "torch" (the reference), "triton" (the kernel: CUDA tensors, or
CPU tensors under TRITON_INTERPRET=1), "auto" (the kernel for CUDA tensors of fp16/bf16/fp32, else
the reference). Launches depend only on shapes (no host syncs, no data-dependent allocations), so
they can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bole.ops.triton_utils import check_kernel_device, fix_interpreter_scalar_index

__all__ = ["IMPLS", "add_rms_norm", "embed_norm_pair", "gated_rms_norm", "silu_mul",
           "tree_conv1d_pool", "conv_windows_from_parents"]

fix_interpreter_scalar_index()

IMPLS = ("auto", "torch", "triton")
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_ROW_BLOCK = 8192   # a norm row up to this many elements stays in registers
_LOOP_BLOCK = 4096      # longer rows are streamed in blocks of this many elements
_TILE = 2048            # elements per program of the row-tiled kernels
_SILU_BLOCK, _CONV_BLOCK = 1024, 512    # column blocks of silu_mul's and the conv's programs


def _num_warps(elems: int) -> int:
    """Warps for a program holding ``elems`` elements (about 8-32 per thread)."""
    return next(w for lo, w in ((8192, 16), (2048, 8), (512, 4), (128, 2), (0, 1)) if elems >= lo)


# ---- kernels ----

@triton.jit
def _row_sum(x_row, r_row, s_row, o, m, HAS_RES: tl.constexpr, STORE: tl.constexpr):
    """fp32 values of ``x + res`` rounded once to x's dtype (stored to s_row with STORE)."""
    s = tl.load(x_row + o, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        s += tl.load(r_row + o, mask=m, other=0.0).to(tl.float32)
        s = s.to(x_row.dtype.element_ty).to(tl.float32)
        if STORE:
            tl.store(s_row + o, s.to(s_row.dtype.element_ty), mask=m)
    return s


@triton.jit
def _store_normed(o_row, w, s, rstd, o, m):
    wv = tl.load(w + o, mask=m, other=0.0).to(tl.float32)
    tl.store(o_row + o, (s * rstd * (1.0 + wv)).to(o_row.dtype.element_ty), mask=m)


@triton.jit
def _add_rms_norm_kernel(x, res, w, out, summed, H, stride_x, stride_r, stride_o, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    """One program per row of H: ``s = x + res``, ``out = s / rms(s) * (1 + w)``."""
    row = tl.program_id(0).to(tl.int64)
    _norm_row(x + row * stride_x, res + row * stride_r, w, summed + row * H, out + row * stride_o,
              H, eps, HAS_RES, BLOCK, ONE_BLOCK)


@triton.jit
def _embed_norm_pair_kernel(tokens, table, prev, w_embed, w_prev, out, H, stride_t, stride_p,
                            stride_o, eps, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    """Program (row, half): half 0 normalises the embedding of ``tokens[row]`` into the row's
    first H columns, half 1 the row of ``prev`` into the last H."""
    row = tl.program_id(0).to(tl.int64)
    o_row = out + row * stride_o
    if tl.program_id(1) == 0:
        src = table + tl.load(tokens + row).to(tl.int64) * stride_t
        _norm_row(src, src, w_embed, o_row, o_row, H, eps, False, BLOCK, ONE_BLOCK)
    else:
        src = prev + row * stride_p
        _norm_row(src, src, w_prev, o_row + H, o_row + H, H, eps, False, BLOCK, ONE_BLOCK)


@triton.jit
def _norm_row(x_row, r_row, w, s_row, o_row, H, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
              ONE_BLOCK: tl.constexpr):
    """One row: ``s = x + r`` (stored to s_row with HAS_RES), ``o = s / rms(s) * (1 + w)``."""
    if ONE_BLOCK:       # the whole row stays in registers
        o = tl.arange(0, BLOCK)
        s = _row_sum(x_row, r_row, s_row, o, o < H, HAS_RES, True)
        _store_normed(o_row, w, s, tl.rsqrt(tl.sum(s * s, 0) / H + eps), o, o < H)
    else:               # sum of squares block by block, then a second pass over the (cached) row
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for off in range(0, H, BLOCK):
            o = off + tl.arange(0, BLOCK)
            s = _row_sum(x_row, r_row, s_row, o, o < H, HAS_RES, True)
            acc += s * s
        rstd = tl.rsqrt(tl.sum(acc, 0) / H + eps)
        for off in range(0, H, BLOCK):
            o = off + tl.arange(0, BLOCK)
            s = _row_sum(x_row, r_row, s_row, o, o < H, HAS_RES, False)
            _store_normed(o_row, w, s, rstd, o, o < H)


@triton.jit(do_not_specialize=["rows"])
def _gated_rms_norm_kernel(x, z, w, out, rows, Hv, D, sxn, sxh, szn, szh, eps,
                           ROUND_PROD: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """ROWS rows of D per program: ``w * round(x / rms(x)) * silu(z)``."""
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    n, h = r // Hv, r % Hv
    d = tl.arange(0, BLOCK_D)
    m = (r < rows)[:, None] & (d < D)[None, :]
    dt = x.dtype.element_ty
    xv = tl.load(x + (n * sxn + h * sxh)[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xv * xv, 1) / D + eps)
    hn = (xv * rstd[:, None]).to(dt).to(tl.float32)                  # h.to(dt)
    hw = tl.load(w + d, mask=d < D, other=0.0).to(tl.float32)[None, :] * hn
    if ROUND_PROD:      # w * h is computed in x's 16-bit dtype when w shares it
        hw = hw.to(dt).to(tl.float32)
    zv = tl.load(z + (n * szn + h * szh)[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
    y = hw * (zv * tl.sigmoid(zv))
    tl.store(out + r[:, None] * D + d[None, :], y.to(dt), mask=m)


@triton.jit
def _silu_mul_kernel(gu, out, I, stride_row, n_blocks, BLOCK: tl.constexpr):
    """One program per (row, block of BLOCK columns): ``round(silu(gate)) * up``."""
    pid = tl.program_id(0)
    row, o = (pid // n_blocks).to(tl.int64), (pid % n_blocks) * BLOCK + tl.arange(0, BLOCK)
    m = o < I
    g = tl.load(gu + row * stride_row + o, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu + row * stride_row + I + o, mask=m, other=0.0).to(tl.float32)
    dt = out.dtype.element_ty
    a = (g * tl.sigmoid(g)).to(dt).to(tl.float32)                     # F.silu rounds to dt
    tl.store(out + row * I + o, (a * u).to(dt), mask=m)


@triton.jit
def _tree_conv_kernel(x, w, pool, slots, windows, out, C, sx, swc, swk, sps, spc, spk, swn, swj,
                      n_cblocks, K: tl.constexpr, BLOCK_C: tl.constexpr):
    """One program per (node, BLOCK_C channels): ``silu(sum_j w[:, j] * window_j)`` in fp32;
    window entry ``e >= 0`` is row e of x, ``-(r * (K-1) + col) - 1`` is ``pool[slots[r], :, col]``."""
    pid = tl.program_id(0)
    n, c = (pid // n_cblocks).to(tl.int64), (pid % n_cblocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = c < C
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        idx = tl.load(windows + n * swn + j * swj).to(tl.int64)
        code = tl.where(idx >= 0, 0, -idx - 1)
        slot = tl.load(slots + code // (K - 1), mask=idx < 0, other=0).to(tl.int64)
        col = code % (K - 1)
        # per-channel masks from a broadcast index (the interpreter mistypes scalar & vector masks)
        idx_c = idx + tl.zeros([BLOCK_C], dtype=tl.int64)
        v_node = tl.load(x + tl.maximum(idx, 0) * sx + c, mask=mc & (idx_c >= 0), other=0.0)
        v_state = tl.load(pool + slot * sps + c * spc + col * spk, mask=mc & (idx_c < 0), other=0.0)
        wj = tl.load(w + c * swc + j * swk, mask=mc, other=0.0).to(tl.float32)
        acc += wj * (v_node.to(tl.float32) + v_state.to(tl.float32))
    tl.store(out + n * C + c, (acc * tl.sigmoid(acc)).to(out.dtype.element_ty), mask=mc)


# ---- checks and dispatch ----

def _check(what: str, name: str, t, shape: tuple, doc: str, *, kind: str = "float",
           device: torch.device | None = None, dtype: torch.dtype | None = None,
           rows: bool = False) -> None:
    """``t`` is a tensor of ``shape`` (None: any size) holding floats or ints (``kind``), of
    ``dtype`` on ``device`` (x's, when given); with ``rows`` its last dim is contiguous."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        want = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{what}: {name} has shape {tuple(t.shape)}, expected {doc} = {want}")
    is_int = not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)
    if (kind == "float" and not t.dtype.is_floating_point) or (kind == "int" and not is_int):
        want = "floating point" if kind == "float" else "integer"
        raise TypeError(f"{what}: {name} must be {want}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{what}: {name} is on {t.device} but x is on {device}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{what}: {name} ({t.dtype}) and x ({dtype}) must share a dtype")
    if rows and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{what}: {name} must be contiguous in its last dim, got strides "
                         f"{tuple(t.stride())}")


def _use_triton(impl: str, what: str, x: torch.Tensor, *floats: torch.Tensor) -> bool:
    """Whether to launch the kernel (see the module docstring); raises for impossible requests."""
    if impl not in IMPLS:
        raise ValueError(f"{what}: impl must be one of {IMPLS}, got {impl!r}")
    bad = sorted({str(t.dtype) for t in (x, *floats) if t.dtype not in _KERNEL_DTYPES})
    if impl == "auto":
        return x.device.type == "cuda" and not bad
    if impl == "torch":
        return False
    check_kernel_device(x.device, f"{what}(impl='triton')")
    if bad:
        raise TypeError(f"{what}(impl='triton') supports fp16/bf16/fp32 tensors, got {bad}")
    return True


def _row_tile(what: str, rows: int, width: int) -> tuple[int, int]:
    """(rows per program, block of one row) of the row-tiled kernels, both powers of two."""
    block = triton.next_power_of_2(width)
    if block > _MAX_ROW_BLOCK:
        raise ValueError(f"{what}: rows of {width} elements exceed the kernel's {_MAX_ROW_BLOCK}")
    return max(1, min(triton.next_power_of_2(rows), _TILE // block)), block


# ---- torch references (the model's unfused code, op for op) ----

def _rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.float())).type_as(x)


def _gated_rms_norm_ref(x, z, w, eps) -> torch.Tensor:
    dt = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = w * h.to(dt)
    return (h * F.silu(z.float())).to(dt)


def _tree_conv_ref(x, weight, conv_pool, slots, windows) -> torch.Tensor:
    """bole.ops.conv.tree_conv1d's gather + einsum over ``cat([state rows, x rows])``."""
    C, K = weight.shape
    state = conv_pool[slots.long()]                                   # [R, C, K-1]
    rows = torch.cat([state.transpose(1, 2).reshape(-1, C), x])
    idx = windows.long()
    idx = torch.where(idx >= 0, idx + state.shape[0] * (K - 1), -idx - 1)
    dt = torch.promote_types(torch.float32, x.dtype)
    out = F.silu(torch.einsum("nkc,ck->nc", rows[idx].to(dt), weight.to(dt)))
    return out.to(x.dtype)


# ---- public ops ----

def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                 impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add + zero-centred RMSNorm: ``s = x + residual``, ``s / rms(s) * (1 + weight)``.

    x, residual: ``[N, H]`` of one dtype, last dim contiguous (rows may be strided); weight ``[H]``
    (any float dtype). ``s`` is rounded to x's dtype as ``x + residual`` is, and is ``x`` itself
    without a residual. ``out``: where the normed rows go (``[N, H]`` in x's dtype, rows may be
    strided: half of a wider buffer). Returns ``(normed [N, H], s [N, H])``, both in x's dtype.
    """
    what = "add_rms_norm"
    _check(what, "x", x, (None, None), "[N, H]", rows=True)
    N, H = x.shape
    _check(what, "weight", weight, (H,), "[H]", device=x.device)
    if residual is not None:
        _check(what, "residual", residual, (N, H), "[N, H]", device=x.device, dtype=x.dtype,
               rows=True)
    if out is not None:
        _check(what, "out", out, (N, H), "[N, H]", device=x.device, dtype=x.dtype, rows=True)
    if not _use_triton(impl, what, x, weight):
        s = x if residual is None else x + residual
        normed = _rms_norm_ref(s, weight, eps)
        return (normed if out is None else out.copy_(normed)), s
    if out is None:
        out = torch.empty((N, H), dtype=x.dtype, device=x.device)
    summed = x if residual is None else torch.empty_like(out)
    res = x if residual is None else residual
    one = triton.next_power_of_2(H) <= _MAX_ROW_BLOCK
    block = triton.next_power_of_2(H) if one else _LOOP_BLOCK
    if N:
        _add_rms_norm_kernel[(N,)](
            x, res, weight.contiguous(), out, summed, H, x.stride(0), res.stride(0), out.stride(0),
            float(eps),
            HAS_RES=residual is not None, BLOCK=block, ONE_BLOCK=one, num_warps=_num_warps(block))
    return out, summed


def embed_norm_pair(tokens: torch.Tensor, table: torch.Tensor, prev: torch.Tensor,
                    w_embed: torch.Tensor, w_prev: torch.Tensor, eps: float, *,
                    impl: str = "auto") -> torch.Tensor:
    """The MTP head's fc input in one launch: ``[norm(table[tokens]) | norm(prev)]``, each half
    a zero-centred RMSNorm (:func:`add_rms_norm` without residual) with its own weight.

    tokens ``[N]`` int (valid rows of ``table``), table ``[V, H]`` and prev ``[N, H]`` of one
    dtype (last dims contiguous), weights ``[H]``. Returns ``[N, 2 H]`` in table's dtype."""
    what = "embed_norm_pair"
    _check(what, "table", table, (None, None), "[V, H]", rows=True)
    V, H = table.shape
    _check(what, "tokens", tokens, (None,), "[N]", kind="int", device=table.device)
    N = tokens.shape[0]
    _check(what, "prev", prev, (N, H), "[N, H]", device=table.device, dtype=table.dtype, rows=True)
    _check(what, "w_embed", w_embed, (H,), "[H]", device=table.device)
    _check(what, "w_prev", w_prev, (H,), "[H]", device=table.device)
    if not _use_triton(impl, what, table, prev, w_embed, w_prev):
        out = torch.empty(N, 2 * H, dtype=table.dtype, device=table.device)
        out[:, :H] = _rms_norm_ref(F.embedding(tokens, table), w_embed, eps)
        out[:, H:] = _rms_norm_ref(prev, w_prev, eps)
        return out
    out = torch.empty(N, 2 * H, dtype=table.dtype, device=table.device)
    one = triton.next_power_of_2(H) <= _MAX_ROW_BLOCK
    block = triton.next_power_of_2(H) if one else _LOOP_BLOCK
    if N:
        _embed_norm_pair_kernel[(N, 2)](
            tokens, table, prev, w_embed.contiguous(), w_prev.contiguous(), out, H,
            table.stride(0), prev.stride(0), out.stride(0), float(eps), BLOCK=block,
            ONE_BLOCK=one, num_warps=_num_warps(block))
    return out


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, *,
                   impl: str = "auto") -> torch.Tensor:
    """GDN output norm ``weight * round(x / rms(x)) * silu(z)`` over the last dim.

    x, z: ``[N, H_v, d_v]`` (strided views allowed, last dim contiguous; z may have another float
    dtype); weight ``[d_v]``: ``weight * h`` is computed in the promotion of weight's and x's
    dtypes, as torch does. Returns ``[N, H_v, d_v]`` contiguous in x's dtype.
    """
    what = "gated_rms_norm"
    _check(what, "x", x, (None, None, None), "[N, H_v, d_v]", rows=True)
    N, Hv, D = x.shape
    _check(what, "z", z, (N, Hv, D), "[N, H_v, d_v] like x", device=x.device, rows=True)
    _check(what, "weight", weight, (D,), "[d_v]", device=x.device)
    if not _use_triton(impl, what, x, z, weight):
        return _gated_rms_norm_ref(x, z, weight, eps)
    out = torch.empty((N, Hv, D), dtype=x.dtype, device=x.device)
    rows = N * Hv
    per, block = _row_tile(what, rows, D)
    prod = torch.promote_types(weight.dtype, x.dtype)   # fp32, or x's 16-bit dtype
    if rows:
        _gated_rms_norm_kernel[(triton.cdiv(rows, per),)](
            x, z, weight.contiguous(), out, rows, Hv, D, x.stride(0), x.stride(1), z.stride(0),
            z.stride(1), float(eps), ROUND_PROD=prod != torch.float32, ROWS=per, BLOCK_D=block,
            num_warps=_num_warps(per * block))
    return out


def silu_mul(gate_up: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """``F.silu(gate) * up`` of ``gate_up [N, 2I] = [gate | up]`` (rows may be strided, last dim
    contiguous). Returns ``[N, I]`` contiguous in gate_up's dtype."""
    what = "silu_mul"
    _check(what, "gate_up", gate_up, (None, None), "[N, 2I]", rows=True)
    N, I2 = gate_up.shape
    if I2 % 2:
        raise ValueError(f"{what}: gate_up's last dim must be even [gate | up], got {I2}")
    if not _use_triton(impl, what, gate_up):
        # silu of a contiguous gate, as the model's F.linear output (torch's CPU kernels round
        # strided rows' tails differently)
        return F.silu(gate_up[:, :I2 // 2].contiguous()) * gate_up[:, I2 // 2:]
    I = I2 // 2
    out = torch.empty((N, I), dtype=gate_up.dtype, device=gate_up.device)
    block = min(triton.next_power_of_2(max(I, 1)), _SILU_BLOCK)
    n_blocks = triton.cdiv(I, block)
    if N and I:
        _silu_mul_kernel[(N * n_blocks,)](gate_up, out, I, gate_up.stride(0), n_blocks,
                                          BLOCK=block, num_warps=_num_warps(block))
    return out


def tree_conv1d_pool(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor,
                     slots: torch.Tensor, windows: torch.Tensor, *,
                     impl: str = "auto") -> torch.Tensor:
    """Depthwise causal conv + SiLU of every node of a draft forest, state read from the pool.

    x ``[N, C]`` node inputs (rows may be strided, last dim contiguous); weight ``[C, K]``
    (``weight[:, K-1]`` multiplies the node itself); conv_pool ``[S, C, K-1]`` one GDN layer's
    committed states, oldest first, x's dtype; slots ``[R]`` pool slot of each request; windows
    ``[N, K]`` int32/int64, oldest first: a node index >= 0 into x, or ``-(r * (K-1) + col) - 1``
    for ``conv_pool[slots[r], :, col]`` (see :func:`conv_windows_from_parents`). Accumulates in
    fp32; returns ``[N, C]`` contiguous in x's dtype.
    """
    what = "tree_conv1d_pool"
    _check(what, "x", x, (None, None), "[N, C]", rows=True)
    N, C = x.shape
    _check(what, "weight", weight, (C, None), "[C, K]", device=x.device)
    K = weight.shape[1]
    if K < 2:
        raise ValueError(f"{what}: the conv kernel size K = weight.shape[1] must be >= 2, got {K}")
    _check(what, "conv_pool", conv_pool, (None, C, K - 1), "[S, C, K-1]", device=x.device,
           dtype=x.dtype)
    _check(what, "slots", slots, (None,), "[R]", kind="int", device=x.device)
    _check(what, "windows", windows, (N, K), "[N, K]", kind="int", device=x.device)
    if windows.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{what}: windows must be int32 or int64, got {windows.dtype}")
    if not _use_triton(impl, what, x, weight):
        return _tree_conv_ref(x, weight, conv_pool, slots, windows)
    out = torch.empty((N, C), dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(max(C, 1)), _CONV_BLOCK)
    n_cblocks = triton.cdiv(C, block)
    if N and C:
        _tree_conv_kernel[(N * n_cblocks,)](
            x, weight, conv_pool, slots, windows, out, C, x.stride(0), *weight.stride(),
            *conv_pool.stride(), *windows.stride(), n_cblocks, K=K, BLOCK_C=block,
            num_warps=min(4, _num_warps(block)))
    return out


def conv_windows_from_parents(parents: torch.Tensor, depth: torch.Tensor, K: int) -> torch.Tensor:
    """Conv windows of a dense forest for :func:`tree_conv1d_pool`, built with tensor ops only.

    parents ``[R, T]`` local parent index (-1 for roots and padding), depth ``[R, T]``; node
    ``n = r * T + i``. A node's window is its K-1 nearest ancestors (oldest first), then itself;
    at distance s > depth back it reaches state column ``(K-1) - (s - depth)`` of request r, coded
    ``-(r * (K-1) + col) - 1``. Returns ``[R * T, K]`` int32 on the parents' device.
    """
    what = "conv_windows_from_parents"
    _check(what, "parents", parents, (None, None), "[R, T]", kind="int")
    _check(what, "depth", depth, tuple(parents.shape), "[R, T] like parents", kind="int",
           device=parents.device)
    if not isinstance(K, int) or K < 2:
        raise ValueError(f"{what}: K must be an int >= 2, got {K!r}")
    R, T = parents.shape
    dev = parents.device
    parents, depth = parents.long(), depth.long()
    req = torch.arange(R, device=dev)[:, None]
    base = req * T                                                    # first node of request r
    cur = torch.arange(T, device=dev).expand(R, T)                    # local ancestor so far
    windows = torch.empty((R, T, K), dtype=torch.int32, device=dev)
    windows[..., K - 1] = base + cur
    for s in range(1, K):                                             # s = distance back
        inside = depth >= s
        cur = torch.where(inside, parents.gather(1, cur.clamp(min=0)), cur)
        col = (K - 1) - (s - depth)                                   # used only past the root
        windows[..., K - 1 - s] = torch.where(inside, base + cur, -(req * (K - 1) + col) - 1)
    return windows.reshape(R * T, K)

