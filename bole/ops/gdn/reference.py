"""Serial per-node gated delta rule over a draft tree: the ground truth.

This is the semantics of the ``tree-serial`` baseline (SGLang's design): nodes are visited in
topological order, each starts from its parent's full state (the request's committed state for a
root) and its own state is kept as a snapshot. Obviously correct, slow: T dependent updates.

    S~ = exp(g_i) S_parent;  u_i = beta_i (v_i - S~^T k_i);  S_i = S~ + k_i u_i^T;  o_i = S_i^T q_i
"""

from __future__ import annotations

import torch

from bole.ops.gdn.common import expand_heads, prepare_gdn_tree_inputs
from bole.tree import PackedForest


def tree_gdn_serial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forest: PackedForest, *,
    g=None, beta=None, a=None, b=None, A_log=None, dt_bias=None,
    initial_state: torch.Tensor | None = None, scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False, return_states: bool = False, check_values: bool = True,
):
    """Node-by-node tree recurrence.

    Args: see :mod:`bole.ops.gdn.common` for layouts and gates.
    Returns ``(o, u, states)``: ``o`` like ``v`` in v's dtype; ``u`` ``[N, H_v, d_v]`` the per-node
    corrections in the compute dtype (fp32, or fp64 for fp64 inputs); ``states``
    ``[N, H_v, d_k, d_v]`` every node's state after its update when ``return_states`` else None.
    Padding nodes get zero output, correction and state.
    """
    x = prepare_gdn_tree_inputs(
        q, k, v, forest, g=g, beta=beta, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
        initial_state=initial_state, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        check_values=check_values)
    N, H_v, d_v = x.v.shape
    d_k = x.k.shape[-1]
    qh, kh = expand_heads(x.q, x.group), expand_heads(x.k, x.group)   # [N, H_v, d_k]
    o = torch.zeros_like(x.v)
    u = torch.zeros_like(x.v)
    states = torch.zeros(N, H_v, d_k, d_v, dtype=x.v.dtype, device=x.v.device)
    parent = forest.parent_global.tolist()
    request = forest.request.tolist()
    valid = forest.valid.tolist()
    for i in range(N):
        if not valid[i]:
            continue
        s_prev = x.state[request[i]] if parent[i] < 0 else states[parent[i]]
        s = s_prev * torch.exp(x.g[i])[:, None, None]
        u_i = x.beta[i][:, None] * (x.v[i] - torch.einsum("hkv,hk->hv", s, kh[i]))
        s = s + kh[i][:, :, None] * u_i[:, None, :]
        o[i] = torch.einsum("hkv,hk->hv", s, qh[i])
        u[i] = u_i
        states[i] = s
    return o.reshape(x.out_shape).to(x.out_dtype), u, (states if return_states else None)


def chain_gdn_recurrent(q, k, v, g, beta, initial_state=None, scale=None,
                        use_qk_l2norm_in_kernel: bool = False):
    """Plain recurrence over ``B`` independent chains ``[B, T, ...]``: ``(o, final_state)``.

    The chain special case of :func:`tree_gdn_serial`, with fla's return convention.
    """
    B, T = q.shape[:2]
    forest = PackedForest.from_parents(torch.arange(-1, T - 1).expand(B, T))
    o, _, states = tree_gdn_serial(
        q, k, v, forest, g=g, beta=beta, initial_state=initial_state, scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, return_states=True)
    return o, states[forest.cu_nodes[1:] - 1]
