"""Shared input handling for every GDN tree operation (reference, closed form, Triton).

Layout (fla / transformers, docs/design.md section 4), time-major, with ``B * T == forest.num_nodes``:
a packed ragged forest is passed as ``B = 1, T = N``; ``B`` equal-sized trees as ``[B, T]``.

    q, k          [B, T, H_k, d_k]
    v             [B, T, H_v, d_v]      H_v a multiple of H_k; value head h reads key head h // (H_v // H_k)
    g, beta       [B, T, H_v]           g natural-log decay (<= 0), beta write strength
    initial_state [R, H_v, d_k, d_v]    fp32 (or fp64), the committed state S_pre of each request

Instead of ``g``/``beta`` the raw gate inputs may be given: ``a, b [B, T, H_v]`` with
``A_log, dt_bias [H_v]``; then ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``,
computed in fp32 as transformers and fla do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bole.tree import PackedForest

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
STATE_DTYPES = (torch.float32, torch.float64)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (fla's and transformers' convention)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gates_from_raw(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                   dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, beta)`` in fp32 (fp64 if the inputs are fp64) from the raw projections."""
    dt = torch.promote_types(torch.float32, a.dtype)
    g = -torch.exp(A_log.to(dt)) * F.softplus(a.to(dt) + dt_bias.to(dt))
    beta = torch.sigmoid(b.to(dt))
    return g, beta


@dataclass
class GDNTreeInputs:
    """Validated inputs flattened to packed form ``[N, ...]``, in the compute dtype.

    q, k: [N, H_k, d_k] (l2-normalised if asked; q already scaled); v: [N, H_v, d_v];
    g, beta: [N, H_v]; state: [R, H_v, d_k, d_v]; ``out_shape``/``out_dtype`` restore the output.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    state: torch.Tensor
    forest: PackedForest
    out_shape: tuple[int, ...]
    out_dtype: torch.dtype

    @property
    def group(self) -> int:
        return self.v.shape[1] // self.k.shape[1]


def _check_finite(name: str, x: torch.Tensor) -> None:
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{name} holds {bad} NaN/inf value(s); every input must be finite")


def _check_shape(name: str, x: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {shape} ({what})")


def check_gdn_tensors(q, k, v, g, beta, a, b, A_log, dt_bias, initial_state,
                      num_requests: int | None, check_values: bool = True,
                      resolve_raw_gates: bool = True):
    """Validate shapes, dtypes and values of the GDN inputs and resolve the gates.

    Returns ``(B, T, H_k, d_k, H_v, d_v, g, beta)`` with ``g``/``beta`` resolved to fp32 (fp64 when
    the inputs are fp64). Shared by every implementation so they reject the same inputs alike.
    ``num_requests=None`` skips the state's shape check (kernels reading a state pool check the
    pool themselves). A kernel that fuses the gating passes ``resolve_raw_gates=False``: raw gates
    are then validated but not computed, and ``g``/``beta`` come back as None.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in INPUT_DTYPES:
            raise TypeError(f"{name} has dtype {x.dtype}; supported are fp16, bf16, fp32 and fp64")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D time-major [B, T, H, d], got shape {tuple(x.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, T, H_k, d_k = q.shape
    _check_shape("k", k, (B, T, H_k, d_k), "must match q")
    if v.shape[:2] != (B, T):
        raise ValueError(f"v has shape {tuple(v.shape)}, expected [B={B}, T={T}, H_v, d_v] like q")
    H_v, d_v = v.shape[2], v.shape[3]
    if H_v % H_k != 0:
        raise ValueError(f"value heads H_v={H_v} must be a multiple of key heads H_k={H_k}")

    if g is None and beta is None and a is not None:
        if b is None or A_log is None or dt_bias is None:
            raise ValueError("raw gating needs all of a, b, A_log and dt_bias")
        for name, x in (("a", a), ("b", b)):
            if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
                raise TypeError(f"{name} must be a floating-point tensor")
            _check_shape(name, x, (B, T, H_v), "[B, T, H_v]")
        for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
            if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
                raise TypeError(f"{name} must be a floating-point tensor")
            _check_shape(name, x, (H_v,), "one value per value head")
        if check_values:
            for name, x in (("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
                _check_finite(name, x)
        if resolve_raw_gates:
            g, beta = gates_from_raw(a, b, A_log, dt_bias)
    elif g is not None and beta is not None:
        if a is not None or b is not None:
            raise ValueError("pass either g and beta, or the raw gates a, b with A_log, dt_bias; not both")
        for name, x in (("g", g), ("beta", beta)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if not x.dtype.is_floating_point:
                raise TypeError(f"{name} must be floating point, got {x.dtype}")
            _check_shape(name, x, (B, T, H_v), "[B, T, H_v]")
    else:
        raise ValueError("give the gates: g and beta, or a and b with A_log and dt_bias")

    dt = torch.promote_types(torch.float32, q.dtype)
    if g is not None:
        g, beta = g.to(dt), beta.to(dt)
    if check_values:
        for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
            if x is not None:
                _check_finite(name, x)
        if g is not None and bool((g > 0).any()):
            raise ValueError(
                f"g must be a log-decay <= 0 (decay exp(g) <= 1); got max g = {float(g.max()):.3g}")
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError("initial_state must be a torch.Tensor")
        if initial_state.dtype not in STATE_DTYPES:
            raise TypeError(
                f"initial_state has dtype {initial_state.dtype}; the recurrent state is kept in fp32")
        if num_requests is not None:
            _check_shape("initial_state", initial_state, (num_requests, H_v, d_k, d_v),
                         "[R, H_v, d_k, d_v], one committed state per request")
        if check_values:
            _check_finite("initial_state", initial_state)
    return B, T, H_k, d_k, H_v, d_v, g, beta


def prepare_gdn_tree_inputs(
    q, k, v, forest: PackedForest, *, g=None, beta=None, a=None, b=None, A_log=None, dt_bias=None,
    initial_state=None, scale: float | None = None, use_qk_l2norm_in_kernel: bool = False,
    check_values: bool = True,
) -> GDNTreeInputs:
    """Validate, resolve gates, normalise and flatten to the packed compute layout."""
    if not isinstance(forest, PackedForest):
        raise TypeError(f"forest must be a PackedForest, got {type(forest).__name__}")
    R = forest.num_requests
    B, T, H_k, d_k, H_v, d_v, g, beta = check_gdn_tensors(
        q, k, v, g, beta, a, b, A_log, dt_bias, initial_state, R, check_values)
    if B * T != forest.num_nodes:
        raise ValueError(
            f"inputs carry B*T = {B}*{T} = {B * T} nodes but the forest has {forest.num_nodes}; "
            "pass a packed forest as B=1, T=N")
    dt = torch.promote_types(torch.float32, q.dtype)
    qf = q.reshape(B * T, H_k, d_k).to(dt)
    kf = k.reshape(B * T, H_k, d_k).to(dt)
    if use_qk_l2norm_in_kernel:
        qf, kf = l2norm(qf), l2norm(kf)
    qf = qf * (d_k ** -0.5 if scale is None else scale)
    if initial_state is None:
        state = torch.zeros(R, H_v, d_k, d_v, dtype=dt, device=q.device)
    else:
        state = initial_state.to(dt)
    return GDNTreeInputs(
        q=qf, k=kf, v=v.reshape(B * T, H_v, d_v).to(dt),
        g=g.reshape(B * T, H_v), beta=beta.reshape(B * T, H_v), state=state,
        forest=forest, out_shape=tuple(v.shape), out_dtype=v.dtype)


def expand_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """Key-head tensor ``[..., H_k, d]`` -> value-head layout ``[..., H_v, d]`` (GVA)."""
    return x if group == 1 else x.repeat_interleave(group, dim=-2)
