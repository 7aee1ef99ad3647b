"""One plain-decoding step of the gated delta rule, updating the state pool in place (T = 1).

    S <- exp(g) S;   u = beta (v - S^T k);   S <- S + k u^T;   o = S^T q

with q, k l2-normalised (optionally) and q scaled, gates from the raw projections
(``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)``): the serial reference's update
(:mod:`bole.ops.gdn.reference`) for a lone root. Plain decoding accepts every request's root, so
its step can write each slot's state straight back: one read and one write of the state, where
the closed form's T = 1 verify reads it and the factored commit reads and writes it again. The
engine uses it for ``ar`` on the GPU (batch backend ``triton-decode``; ``torch-decode`` is the
reference). Rows of the same slot (padding rows on the cache's dummy slot) race harmlessly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bole.ops.gdn.common import gates_from_raw, l2norm
from bole.ops.triton_utils import check_kernel_device

__all__ = ["gdn_decode_inplace"]

L2_EPS = 1e-6


@triton.jit(do_not_specialize=["R"])
def _gdn_decode_kernel(q, k, v, a, b, A_log, dt_bias, pool, slots, o, R, DK, DV, scale,
                       sqn, sqh, skn, skh, svn, svh, san, sbn, son, soh, sps, sph, spk,
                       GROUP: tl.constexpr, L2NORM: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr):
    """Program (row r, value head h, value tile): the tile ``S[:, tile]`` of r's slot, updated
    in place, and o's tile."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    hk = h // GROUP
    kk = tl.arange(0, BK)
    km = kk < DK
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    vm = vv < DV
    qv = tl.load(q + r * sqn + hk * sqh + kk, mask=km, other=0.0).to(tl.float32)
    kv = tl.load(k + r * skn + hk * skh + kk, mask=km, other=0.0).to(tl.float32)
    if L2NORM:
        qv = qv * tl.rsqrt(tl.sum(qv * qv, 0) + 1e-6)
        kv = kv * tl.rsqrt(tl.sum(kv * kv, 0) + 1e-6)
    qv = qv * scale
    x = tl.load(a + r * san + h).to(tl.float32) + tl.load(dt_bias + h).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))      # torch's threshold
    decay = tl.exp(-tl.exp(tl.load(A_log + h).to(tl.float32)) * softplus)
    beta = tl.sigmoid(tl.load(b + r * sbn + h).to(tl.float32))
    slot = tl.load(slots + r).to(tl.int64)
    ptr = pool + slot * sps + h * sph + kk[:, None] * spk + vv[None, :]
    m = km[:, None] & vm[None, :]
    s = tl.load(ptr, mask=m, other=0.0) * decay
    vals = tl.load(v + r * svn + h * svh + vv, mask=vm, other=0.0).to(tl.float32)
    u = beta * (vals - tl.sum(s * kv[:, None], 0))
    s = s + kv[:, None] * u[None, :]
    tl.store(ptr, s, mask=m)
    tl.store(o + r * son + h * soh + vv, tl.sum(s * qv[:, None], 0).to(o.dtype.element_ty),
             mask=vm)


def _decode_torch(q, k, v, a, b, A_log, dt_bias, pool, slots, scale, l2):
    dt = pool.dtype
    qf, kf = q.to(dt), k.to(dt)
    if l2:
        qf, kf = l2norm(qf, L2_EPS), l2norm(kf, L2_EPS)
    group = v.shape[1] // q.shape[1]
    qf = qf.repeat_interleave(group, dim=1) * scale              # [R, H_v, d_k]
    kf = kf.repeat_interleave(group, dim=1)
    g, beta = gates_from_raw(a, b, A_log, dt_bias)
    idx = slots.long()
    s = pool[idx] * torch.exp(g.to(dt))[:, :, None, None]        # [R, H_v, d_k, d_v]
    u = beta.to(dt)[:, :, None] * (v.to(dt) - torch.einsum("rhkv,rhk->rhv", s, kf))
    s = s + kf[:, :, :, None] * u[:, :, None, :]
    pool[idx] = s
    return torch.einsum("rhkv,rhk->rhv", s, qf).to(v.dtype)


def gdn_decode_inplace(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                       b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                       pool: torch.Tensor, slots: torch.Tensor, *, scale: float | None = None,
                       use_qk_l2norm_in_kernel: bool = True, impl: str = "auto") -> torch.Tensor:
    """One decode step of R requests, their states updated in ``pool``.

    q, k: ``[R, H_k, d_k]``; v: ``[R, H_v, d_v]`` (``H_v`` a multiple of ``H_k``, last dims
    contiguous); a, b: ``[R, H_v]`` raw gate projections; A_log, dt_bias: ``[H_v]``; pool:
    ``[S, H_v, d_k, d_v]`` fp32 (fp64 on the torch path), contiguous; slots: ``[R]`` integer.
    Returns ``o [R, H_v, d_v]`` in v's dtype. ``impl``: "torch", "triton" (CUDA, or the CPU
    interpreter) or "auto" (the kernel for CUDA tensors)."""
    R, Hk, dk = q.shape
    if k.shape != q.shape or v.dim() != 3 or v.shape[0] != R or v.shape[1] % Hk:
        raise ValueError(f"gdn_decode_inplace: q {tuple(q.shape)}, k {tuple(k.shape)} and v "
                         f"{tuple(v.shape)} must be [R, H_k, d_k], [R, H_k, d_k], [R, H_v, d_v] "
                         "with H_v a multiple of H_k")
    Hv, dv = v.shape[1:]
    if a.shape != (R, Hv) or b.shape != (R, Hv) or A_log.shape != (Hv,) or \
            dt_bias.shape != (Hv,):
        raise ValueError(f"gdn_decode_inplace: a, b must be [R, H_v] = {(R, Hv)} and A_log, "
                         f"dt_bias [H_v]; got {tuple(a.shape)}, {tuple(b.shape)}, "
                         f"{tuple(A_log.shape)}, {tuple(dt_bias.shape)}")
    if pool.dim() != 4 or tuple(pool.shape[1:]) != (Hv, dk, dv) or not pool.is_contiguous():
        raise ValueError(f"gdn_decode_inplace: pool {tuple(pool.shape)} must be a contiguous "
                         f"[S, H_v, d_k, d_v] = [S, {Hv}, {dk}, {dv}]")
    if slots.shape != (R,) or slots.dtype.is_floating_point:
        raise ValueError(f"gdn_decode_inplace: slots must be [R] = [{R}] integers, got "
                         f"{tuple(slots.shape)} {slots.dtype}")
    scale = dk ** -0.5 if scale is None else float(scale)
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"gdn_decode_inplace: impl must be auto, torch or triton, got {impl!r}")
    if impl == "torch" or (impl == "auto" and q.device.type != "cuda"):
        return _decode_torch(q, k, v, a, b, A_log, dt_bias, pool, slots, scale,
                             use_qk_l2norm_in_kernel)
    check_kernel_device(q.device, "gdn_decode_inplace(impl='triton')")
    if pool.dtype != torch.float32:
        raise TypeError(f"gdn_decode_inplace: the kernel keeps fp32 states, got {pool.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b)):
        if t.stride(-1) != 1:
            raise ValueError(f"gdn_decode_inplace: {name} must be contiguous in its last dim")
    o = torch.empty(R, Hv, dv, dtype=v.dtype, device=v.device)
    BK = triton.next_power_of_2(dk)
    BV = min(triton.next_power_of_2(dv), max(16, 4096 // BK))
    if R:
        _gdn_decode_kernel[(R, Hv, triton.cdiv(dv, BV))](
            q, k, v, a, b, A_log, dt_bias, pool, slots, o, R, dk, dv, scale,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            a.stride(0), b.stride(0), o.stride(0), o.stride(1), pool.stride(0), pool.stride(1),
            pool.stride(2), GROUP=Hv // Hk, L2NORM=use_qk_l2norm_in_kernel, BK=BK, BV=BV,
            num_warps=4)
    return o

