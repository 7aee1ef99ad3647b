"""GDN tree verification and commit in torch for the fixed-shape layout (the CPU engine path).

The engine runs R requests x T node slots (:mod:`bole.forest`); these are the torch forms of the
operations the Triton kernels do on the GPU, batched over requests and heads with no per-request
Python loop and no host synchronisation:

    tree_gdn_closed_form_dense   Algorithm 1 (closed form + factors), triangular solve
    tree_gdn_serial_dense        the tree-serial semantics: a full state per node, level by level
    commit_factored_paths        Algorithm 2 for every layer at once, in place in the state pool
    commit_snapshots             the tree-serial copy commit

Inputs are flat node-major: q, k ``[N, H_k, d_k]``, v ``[N, H_v, d_v]``, raw gates a, b
``[N, H_v]`` with ``A_log, dt_bias [H_v]``; the state pool ``[S, H_v, d_k, d_v]`` fp32 is read at
``slots [R]``. The oracles are :mod:`bole.ops.gdn.closed_form` and :mod:`bole.ops.gdn.reference`.
"""

from __future__ import annotations

import torch

from bole.ops.gdn.closed_form import TreeFactors
from bole.ops.gdn.common import expand_heads, gates_from_raw, l2norm

__all__ = ["tree_gdn_closed_form_dense", "tree_gdn_serial_dense", "commit_factored_paths",
           "commit_snapshots"]


def _prepare(q, k, v, a, b, A_log, dt_bias, state_pool, slots, R, scale, use_l2norm):
    """Per-request head-major compute tensors: q, k ``[R, H_v, T, d_k]``, v ``[R, H_v, T, d_v]``,
    g, beta ``[R, H_v, T]`` (fp32), S_pre ``[R, H_v, d_k, d_v]`` and the keys ``[N, H_k, d_k]``."""
    N, H_k, d_k = q.shape
    H_v, d_v = v.shape[1], v.shape[2]
    if N % R:
        raise ValueError(f"{N} nodes do not split into {R} requests of equal slots")
    T, group = N // R, H_v // H_k
    dt = torch.promote_types(torch.float32, q.dtype)
    qf, kf = q.to(dt), k.to(dt)
    if use_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    qf = qf * (d_k ** -0.5 if scale is None else scale)
    g, beta = gates_from_raw(a, b, A_log, dt_bias)

    def heads(x, d):                                   # [N, H_v, d] -> [R, H_v, T, d]
        return x.reshape(R, T, H_v, d).transpose(1, 2)
    qh = heads(expand_heads(qf, group), d_k)
    kh = heads(expand_heads(kf, group), d_k)
    vh = heads(v.to(dt), d_v)
    g = g.to(dt).reshape(R, T, H_v).transpose(1, 2)
    beta = beta.to(dt).reshape(R, T, H_v).transpose(1, 2)
    s_pre = state_pool[slots.long()].to(dt)
    return qh, kh, vh, g, beta, s_pre, kf


def tree_gdn_closed_form_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, a: torch.Tensor, b: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
    ancestors: torch.Tensor, scale: float | None = None, use_qk_l2norm_in_kernel: bool = True,
) -> tuple[torch.Tensor, TreeFactors]:
    """Closed-form verification of R trees of T node slots (``ancestors [R, T, T]``, self included).

    Returns ``(o [N, H_v, d_v]`` in v's dtype, factors)``: ``log_decay [N, H_v]`` fp64, the keys
    as used (normalised) ``[N, H_k, d_k]`` and ``u [N, H_v, d_v]`` in the compute dtype.
    """
    R, T, _ = ancestors.shape
    qh, kh, vh, g, beta, s_pre, keys = _prepare(q, k, v, a, b, A_log, dt_bias, state_pool, slots,
                                                R, scale, use_qk_l2norm_in_kernel)
    dt = vh.dtype
    anc = ancestors[:, None]                                            # [R, 1, T, T]
    strict = anc & ~torch.eye(T, dtype=torch.bool, device=anc.device)
    L = torch.einsum("rij,rhj->rhi", ancestors.double(), g.double())    # [R, H_v, T] path sums
    decay = torch.exp((L[..., :, None] - L[..., None, :]).masked_fill(~anc, float("-inf"))).to(dt)
    G = torch.where(strict, beta[..., None] * decay * (kh @ kh.transpose(-1, -2)), 0.0)
    C = decay * (qh @ kh.transpose(-1, -2))
    e_L = torch.exp(L).to(dt)[..., None]
    rhs = beta[..., None] * (vh - e_L * (kh @ s_pre))
    eye = torch.eye(T, dtype=dt, device=G.device)
    U = torch.linalg.solve_triangular(eye + G, rhs, upper=False, unitriangular=True)
    o = e_L * (qh @ s_pre) + C @ U                                      # [R, H_v, T, d_v]
    N, H_v, d_v = v.shape
    flat = lambda x: x.transpose(1, 2).reshape(N, H_v, -1)              # noqa: E731
    factors = TreeFactors(log_decay=L.transpose(1, 2).reshape(N, H_v), k=keys, u=flat(U))
    return flat(o).to(v.dtype), factors


def tree_gdn_serial_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, a: torch.Tensor, b: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
    parents: torch.Tensor, depth: torch.Tensor, max_depth: int, scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tree-serial semantics: every node starts from its parent's full state (its request's
    committed state for a root) and keeps its own state; levels are visited in depth order.

    ``parents, depth [R, T]`` local. Returns ``(o [N, H_v, d_v]`` in v's dtype,
    ``snapshots [N, H_v, d_k, d_v])`` in the compute dtype."""
    R, T = parents.shape
    qh, kh, vh, g, beta, s_pre, _ = _prepare(q, k, v, a, b, A_log, dt_bias, state_pool, slots,
                                             R, scale, use_qk_l2norm_in_kernel)
    H_v, d_k, d_v = s_pre.shape[1:]
    states = s_pre[:, :, None].expand(R, H_v, T, d_k, d_v).clone()      # [R, H_v, T, d_k, d_v]
    o = torch.zeros_like(vh)
    index = parents.clamp(min=0)[:, None, :, None, None].expand_as(states)
    for level in range(max_depth + 1):
        parent_state = torch.gather(states, 2, index)
        start = torch.where((parents >= 0)[:, None, :, None, None], parent_state,
                            s_pre[:, :, None])
        s = start * torch.exp(g)[..., None, None]
        u = beta[..., None] * (vh - torch.einsum("rhtkv,rhtk->rhtv", s, kh))
        s = s + kh[..., None] * u[..., None, :]
        here = (depth == level)[:, None, :]
        states = torch.where(here[..., None, None], s, states)
        o = torch.where(here[..., None], torch.einsum("rhtkv,rhtk->rhtv", s, qh), o)
    N = R * T
    return (o.transpose(1, 2).reshape(N, H_v, d_v).to(v.dtype),
            states.transpose(1, 2).reshape(N, H_v, d_k, d_v))


def commit_factored_paths(factors: TreeFactors, state_pool: torch.Tensor, slots: torch.Tensor,
                          path_index: torch.Tensor, path_lengths: torch.Tensor) -> torch.Tensor:
    """Algorithm 2 for every layer at once, in place: the torch twin of
    :func:`bole.ops.gdn.triton_commit.commit_factored_triton` (same arguments).

    factors stacked over layers (``log_decay [Ly, N, H_v]``, keys ``[Ly, N, H_k, d_k]``, ``u``),
    ``state_pool [Ly, S, H_v, d_k, d_v]``, ``slots [R]``, ``path_index [R, P]`` flat node
    indices root first (padded), ``path_lengths [R]`` (0 leaves the request's state as it is)."""
    L, u = factors.log_decay, factors.u
    k = factors.keys()
    P = path_index.shape[1]
    mask = torch.arange(P, device=L.device)[None, :] < path_lengths[:, None]
    last = torch.gather(path_index, 1, (path_lengths - 1).clamp(min=0)[:, None])[:, 0]
    group = L.shape[-1] // k.shape[-2]
    L_path = L[:, path_index]                                           # [Ly, R, P, H_v]
    L_acc = L[:, last]                                                  # [Ly, R, H_v]
    w = torch.exp((L_acc[:, :, None].double() - L_path.double()).masked_fill(
        ~mask[None, :, :, None], float("-inf")))
    k_path = expand_heads(k[:, path_index], group)                      # [Ly, R, P, H_v, d_k]
    u_path = u[:, path_index]
    slots = slots.long()
    state = state_pool[:, slots]
    new = torch.exp(L_acc.double()).to(state.dtype)[..., None, None] * state + torch.einsum(
        "lrph,lrphk,lrphv->lrhkv", w.to(state.dtype), k_path.to(state.dtype),
        u_path.to(state.dtype))
    # a request with an empty path (a padding row) keeps its state
    state_pool[:, slots] = torch.where((path_lengths > 0)[None, :, None, None, None], new, state)
    return state_pool


def commit_snapshots(snapshots: list[torch.Tensor], state_pool: torch.Tensor,
                     slots: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """The tree-serial copy commit: pool slot ``slots[r]`` of layer l takes
    ``snapshots[l][accepted[r]]`` (``accepted [R]`` flat node indices)."""
    slots = slots.long()
    for layer, snaps in enumerate(snapshots):
        state_pool[layer, slots] = snaps[accepted.long()].to(state_pool.dtype)
    return state_pool
