"""Exact closed-form tree verification (Algorithm 1) and the factored commit (Algorithm 2), in torch.

For one request and value head, with ``A(i)`` the strict ancestors of node i and path log-decay
``L_i = sum of g over A(i) + {i}`` (docs/design.md section 2):

    (I + G) U = R,   G_ij = beta_i e^{L_i - L_j} (k_i . k_j)   for j in A(i), else 0
    R = diag(beta) (V - diag(e^L) K S_pre)
    O = diag(e^L) Q S_pre + C U,   C_ij = e^{L_i - L_j} (q_i . k_j)   for j in A(i) + {i}, else 0

G is strictly lower triangular and nilpotent (G^{depth+1} = 0), so U needs at most ``depth``
products. Decays are formed from differences ``L_i - L_j`` masked to -inf *before* exp.

The per-node factors ``(L, k, u)`` replace per-node states: the state after any node a is

    S_a = e^{L_a} S_pre + sum_{j in A(a) + {a}} e^{L_a - L_j} k_j u_j^T

and only the accepted node's state is ever built (:func:`commit_factored`).
This module is the CPU path and the oracle for the Triton kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from bole.ops.gdn.common import expand_heads, prepare_gdn_tree_inputs
from bole.tree import PackedForest

Solve = Literal["neumann", "squaring", "substitution"]


@dataclass
class TreeFactors:
    """Per-node factors of one GDN layer (or ``L`` layers stacked on a leading dim).

    log_decay: ``[..., N, H_v]`` fp64 path log-decays L_i (<= 0); fp64 because the commit forms
               ``L_a - L_j`` of two long paths, which would lose ``eps * |L|`` in fp32.
    k:         ``[..., N, H_k, d_k]`` keys as used by the update (after l2-normalisation).
    u:         ``[..., N, H_v, d_v]`` corrections U, the solution of (I + G) U = R.
    k_inv_norm: optional ``[..., N, H_k]``; when set, the key used is ``k * k_inv_norm`` (a kernel
               that l2-normalises in-kernel keeps the raw keys and writes only these scalars).
    """

    log_decay: torch.Tensor
    k: torch.Tensor
    u: torch.Tensor
    k_inv_norm: torch.Tensor | None = None

    @staticmethod
    def stack(layers: Sequence["TreeFactors"]) -> "TreeFactors":
        """Stack per-layer factors on a new leading layer dim, for the cross-layer commit."""
        norms = [f.k_inv_norm for f in layers]
        if any(n is None for n in norms) and not all(n is None for n in norms):
            raise ValueError("cannot stack factors with and without k_inv_norm")
        return TreeFactors(
            *(torch.stack([getattr(f, n) for f in layers]) for n in ("log_decay", "k", "u")),
            k_inv_norm=None if norms[0] is None else torch.stack(norms))

    def keys(self) -> torch.Tensor:
        """The keys the update used, ``[..., N, H_k, d_k]``."""
        if self.k_inv_norm is None:
            return self.k
        k = self.k.to(torch.promote_types(self.k.dtype, self.k_inv_norm.dtype))
        return k * self.k_inv_norm[..., None].to(k.dtype)


#: deepest tree whose Neumann iterates stay inside fp32: they can grow like (1 + beta)^depth
#: before converging (a chain of near-parallel keys, g = 0, beta = 1 overflows near depth 128);
#: deeper fp32/fp16 solves use triangular substitution instead
NEUMANN_MAX_DEPTH_FP32 = 96
#: repeated squaring forms (-G)^(2^j), whose rounding grows with the depth: beyond this it lost
#: accuracy in fp64 (2e-4 at depth 48, 6.5 at depth 64), so it is refused there
SQUARING_MAX_DEPTH = 32


def solve_unit_lower(G: torch.Tensor, R: torch.Tensor, depth: int, method: Solve = "neumann"):
    """Solve ``(I + G) U = R`` for strictly lower-triangular nilpotent ``G`` (``G^{depth+1} = 0``).

    G: ``[..., T, T]``, R: ``[..., T, d]``. ``neumann`` iterates ``U <- R - G U`` ``depth`` times
    (after m sweeps every node of depth <= m is exact; past :data:`NEUMANN_MAX_DEPTH_FP32` in
    fp32 or lower it solves by substitution instead, since the iterates can overflow);
    ``squaring`` applies ``prod_j (I + (-G)^{2^j})`` in ceil(log2(depth + 1)) rounds (refused past
    :data:`SQUARING_MAX_DEPTH`, where its rounding grows); ``substitution`` is a triangular
    solve. All three are exact in exact arithmetic.
    """
    if method == "neumann" and depth > NEUMANN_MAX_DEPTH_FP32 and G.dtype != torch.float64:
        method = "substitution"
    if method == "squaring" and depth > SQUARING_MAX_DEPTH:
        raise ValueError(f"solve='squaring' loses accuracy past depth {SQUARING_MAX_DEPTH} "
                         f"(this tree has depth {depth}); use 'neumann' or 'substitution'")
    if method == "neumann":
        U = R
        for _ in range(depth):
            U = R - G @ U
        return U
    if method == "squaring":
        U, P = R, -G
        covered = 1                     # terms (-G)^0 .. (-G)^{covered-1} are in U
        while covered < depth + 1:
            U = U + P @ U
            covered *= 2
            if covered < depth + 1:
                P = P @ P
        return U
    if method == "substitution":
        eye = torch.eye(G.shape[-1], dtype=G.dtype, device=G.device)
        return torch.linalg.solve_triangular(eye + G, R, upper=False, unitriangular=True)
    raise ValueError(f"unknown solve method {method!r}; use 'neumann', 'squaring' or 'substitution'")


def tree_gdn_closed_form(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forest: PackedForest, *,
    g=None, beta=None, a=None, b=None, A_log=None, dt_bias=None,
    initial_state: torch.Tensor | None = None, scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False, solve: Solve = "neumann", check_values: bool = True,
) -> tuple[torch.Tensor, TreeFactors]:
    """Verify every node of the forest at once.

    Returns ``(o, factors)``: ``o`` like ``v`` in v's dtype; ``k`` and ``u`` in the compute dtype
    (fp32, or fp64 for fp64 inputs), ``log_decay`` in fp64. ``initial_state`` is only read. Padding nodes get zeros.
    """
    x = prepare_gdn_tree_inputs(
        q, k, v, forest, g=g, beta=beta, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
        initial_state=initial_state, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        check_values=check_values)
    dt, dev = x.v.dtype, x.v.device
    o = torch.zeros_like(x.v)
    u = torch.zeros_like(x.v)
    log_decay = torch.zeros(x.g.shape, dtype=torch.float64, device=dev)
    cu = forest.cu_nodes.tolist()
    for r in range(forest.num_requests):
        lo, hi = cu[r], cu[r + 1]
        tree = forest.tree(r)
        anc = tree.ancestor_mask(include_self=True).to(dev)            # [T, T]
        strict = anc & ~torch.eye(hi - lo, dtype=torch.bool, device=dev)
        # Path log-decays in fp64: L_i - L_j of two long paths loses eps * |L| in fp32.
        L = (anc.double() @ x.g[lo:hi].double()).T                      # [H_v, T]
        decay = torch.exp((L[:, :, None] - L[:, None, :]).masked_fill(~anc, float("-inf"))).to(dt)
        qh = expand_heads(x.q[lo:hi], x.group).transpose(0, 1)          # [H_v, T, d_k]
        kh = expand_heads(x.k[lo:hi], x.group).transpose(0, 1)
        vh = x.v[lo:hi].transpose(0, 1)                                 # [H_v, T, d_v]
        beta = x.beta[lo:hi].T[:, :, None]                              # [H_v, T, 1]
        G = torch.where(strict, beta * decay * (kh @ kh.transpose(1, 2)), 0.0)
        C = decay * (qh @ kh.transpose(1, 2))
        s_pre = x.state[r]                                              # [H_v, d_k, d_v]
        e_L = torch.exp(L).to(dt)[:, :, None]
        R = beta * (vh - e_L * (kh @ s_pre))
        U = solve_unit_lower(G, R, tree.max_depth, solve)
        o[lo:hi] = (e_L * (qh @ s_pre) + C @ U).transpose(0, 1)
        u[lo:hi] = U.transpose(0, 1)
        log_decay[lo:hi] = L.T
    return o.reshape(x.out_shape).to(x.out_dtype), TreeFactors(log_decay, x.k, u)


def commit_factored(
    factors: TreeFactors, initial_state: torch.Tensor, forest: PackedForest, accepted, *,
    inplace: bool = False,
) -> torch.Tensor:
    """Build each request's state after its accepted node from the factors.

    Works for one layer (factors ``[N, ...]``, state ``[R, H_v, d_k, d_v]``) and for all GDN layers
    at once (factors and state with a leading layer dim, see :meth:`TreeFactors.stack`).
    ``accepted``: ``[R]`` local index of each request's accepted node (a request of one tree is
    R = 1). Returns the new states; with ``inplace`` they are written into ``initial_state``.

        S_new = e^{L_a} S_pre + sum_{j in path(a)} e^{L_a - L_j} k_j u_j^T
    """
    L, u = factors.log_decay, factors.u
    k = factors.keys()
    single = L.dim() == 2
    if single:
        L, k, u, state = L[None], k[None], u[None], initial_state[None]
    else:
        state = initial_state
    n_layers, N, H_v = L.shape
    if N != forest.num_nodes:
        raise ValueError(f"factors hold {N} nodes but the forest has {forest.num_nodes}")
    R = forest.num_requests
    expect = (n_layers, R, H_v, k.shape[-1], u.shape[-1])
    if tuple(state.shape) != expect:
        raise ValueError(
            f"state has shape {tuple(initial_state.shape)}, expected "
            f"{expect[1:] if single else expect} for these factors and {R} request(s)")
    index, lengths = forest.padded_paths(accepted)
    index, lengths = index.to(L.device), lengths.to(L.device)
    mask = torch.arange(index.shape[1], device=L.device)[None, :] < lengths[:, None]
    last = index[:, -1]                                                  # [R] accepted nodes
    group = H_v // k.shape[-2]
    L_path = L[:, index]                                                 # [Ly, R, P, H_v]
    L_acc = L[:, last]                                                   # [Ly, R, H_v]
    diff = (L_acc[:, :, None].double() - L_path.double()).masked_fill(
        ~mask[None, :, :, None], float("-inf"))
    w = torch.exp(diff)                                                  # 0 off the path
    k_path = expand_heads(k[:, index], group)                            # [Ly, R, P, H_v, d_k]
    u_path = u[:, index]                                                 # [Ly, R, P, H_v, d_v]
    dt = torch.promote_types(state.dtype, u.dtype)
    new = torch.exp(L_acc.double()).to(dt)[..., None, None] * state.to(dt) + torch.einsum(
        "lrph,lrphk,lrphv->lrhkv", w.to(dt), k_path.to(dt), u_path.to(dt))
    new = new.to(state.dtype)
    if inplace:
        state.copy_(new)
        return initial_state
    return new[0] if single else new


def tree_states_from_factors(factors: TreeFactors, initial_state: torch.Tensor,
                             forest: PackedForest) -> torch.Tensor:
    """Every node's state ``[N, H_v, d_k, d_v]`` from the factors (tests and debugging only).

    Materialising all states is exactly what Bole avoids; this exists to check Lemma 1.
    """
    states = []
    for i in range(forest.num_nodes):
        r = int(forest.request[i])
        if r < 0:
            states.append(torch.zeros_like(initial_state[0]))
            continue
        sub = PackedForest.pack([forest.tree(r)])
        lo = int(forest.cu_nodes[r])
        hi = int(forest.cu_nodes[r + 1])
        f = TreeFactors(factors.log_decay[lo:hi], factors.keys()[lo:hi], factors.u[lo:hi])
        states.append(commit_factored(f, initial_state[r:r + 1], sub, [i - lo])[0])
    return torch.stack(states)
