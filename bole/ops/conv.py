"""Depthwise causal conv1d over a draft tree, and the conv-state commit.

The GDN layers run a depthwise causal conv (kernel K = 4, no bias in Qwen3.5/Qwen3-Next) + SiLU over
the [q | k | v] channels. In a tree, node i's window is its K-1 nearest ancestors and itself,
oldest first; above the root the window reaches into the request's committed conv state.

Conventions:
    x           [B, T, C] time-major inputs, ``B * T == forest.num_nodes``
    weight      [C, K] (or transformers' nn.Conv1d layout [C, 1, K]); ``weight[:, K-1]`` multiplies
                the current token, ``weight[:, 0]`` the oldest
    conv_state  [R, C, K-1] the last K-1 committed inputs of each request, oldest first
                (``conv_state[..., -1]`` is the token just before the root). transformers keeps
                ``K`` columns; pass its ``[..., 1:]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bole.tree import PackedForest


def _weight_2d(weight: torch.Tensor) -> torch.Tensor:
    if weight.dim() == 3 and weight.shape[1] == 1:
        return weight[:, 0]
    if weight.dim() != 2:
        raise ValueError(f"conv weight must be [C, K] or [C, 1, K], got shape {tuple(weight.shape)}")
    return weight


def tree_conv_windows(forest: PackedForest, kernel_size: int) -> torch.Tensor:
    """``[N, K]`` indices into ``cat([conv_state rows, x rows])`` forming each node's window.

    Index ``r * (K-1) + s`` is state column ``s`` of request r; index ``R * (K-1) + n`` is node n.
    A padding node's window points at the node itself in every slot (its output is masked).
    """
    K = kernel_size
    R = forest.num_requests
    n = torch.arange(forest.num_nodes)
    base = R * (K - 1)
    windows = torch.empty(forest.num_nodes, K, dtype=torch.int64)
    windows[:, K - 1] = base + n
    cur = n.clone()                         # current ancestor (global), valid while dist <= depth
    for s in range(1, K):                   # s = distance back from the node
        inside = forest.depth >= s
        cur = torch.where(inside, forest.parent_global[cur.clamp(min=0)], cur)
        # past the root: state column (K-1) - (s - depth) of the node's request
        col = (K - 1) - (s - forest.depth)
        from_state = forest.request.clamp(min=0) * (K - 1) + col.clamp(min=0)
        idx = torch.where(inside, base + cur, from_state)
        idx = torch.where(forest.valid, idx, base + n)
        windows[:, K - 1 - s] = idx
    return windows


def _check_conv(x, weight, conv_state, forest):
    if not isinstance(forest, PackedForest):
        raise TypeError(f"forest must be a PackedForest, got {type(forest).__name__}")
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, C], got shape {tuple(x.shape)}")
    B, T, C = x.shape
    if B * T != forest.num_nodes:
        raise ValueError(f"x carries {B * T} nodes but the forest has {forest.num_nodes}")
    w = _weight_2d(weight)
    if w.shape[0] != C:
        raise ValueError(f"conv weight has {w.shape[0]} channels but x has {C}")
    K = w.shape[1]
    expect = (forest.num_requests, C, K - 1)
    if tuple(conv_state.shape) != expect:
        raise ValueError(f"conv_state has shape {tuple(conv_state.shape)}, expected {expect} [R, C, K-1]")
    if not (x.dtype == conv_state.dtype):
        raise TypeError(f"x ({x.dtype}) and conv_state ({conv_state.dtype}) must share one dtype")
    return B, T, C, w, K


def tree_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                forest: PackedForest, bias: torch.Tensor | None = None,
                activation: str | None = "silu", windows: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal conv of every tree node over its ancestor window. Returns ``[B, T, C]``.

    ``windows``: :func:`tree_conv_windows` of the forest on x's device, when the caller reuses
    them across layers (they depend only on the forest).
    """
    B, T, C, w, K = _check_conv(x, weight, conv_state, forest)
    if activation not in (None, "silu"):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    rows = torch.cat([conv_state.transpose(1, 2).reshape(-1, C), x.reshape(B * T, C)])
    idx = tree_conv_windows(forest, K).to(x.device) if windows is None else windows
    win = rows[idx]                                                  # [N, K, C]
    dt = torch.promote_types(torch.float32, x.dtype)
    out = torch.einsum("nkc,ck->nc", win.to(dt), w.to(dt))
    if bias is not None:
        out = out + bias.to(dt)
    if activation == "silu":
        out = F.silu(out)
    if forest.num_valid_nodes != forest.num_nodes:   # padding rows out (a host-side test: the
        out = torch.where(forest.valid.to(x.device)[:, None], out, 0.0)   # copy syncs the stream)
    return out.to(x.dtype).reshape(B, T, C)


def conv_commit_rows(forest: PackedForest, accepted, K: int,
                     windows: torch.Tensor | None = None) -> torch.Tensor:
    """``[R, K-1]`` rows of ``cat([conv_state rows, x rows])`` that form each request's new conv
    state (its accepted node's window, oldest first), on ``windows``' device; the same for every
    layer of one commit."""
    nodes, _ = forest.padded_paths(accepted)
    last = nodes[:, -1]                                               # accepted global nodes
    if windows is None:
        windows = tree_conv_windows(forest, K)
    return windows[last.to(windows.device)][:, 1:]


def conv_state_commit(x: torch.Tensor, conv_state: torch.Tensor, forest: PackedForest, accepted,
                      *, inplace: bool = False, windows: torch.Tensor | None = None,
                      rows_index: torch.Tensor | None = None) -> torch.Tensor:
    """The conv state after each request's accepted node: the last K-1 inputs along its path.

    ``accepted``: ``[R]`` local node index per request. Returns ``[R, C, K-1]`` (written into
    ``conv_state`` with ``inplace``). ``rows_index``: :func:`conv_commit_rows` on x's device, when
    the caller commits several layers at once.
    """
    B, T, C = x.shape
    K = conv_state.shape[-1] + 1
    if B * T != forest.num_nodes or conv_state.shape[:2] != (forest.num_requests, C):
        raise ValueError(
            f"x {tuple(x.shape)} / conv_state {tuple(conv_state.shape)} do not match a forest of "
            f"{forest.num_nodes} nodes and {forest.num_requests} requests")
    rows = torch.cat([conv_state.transpose(1, 2).reshape(-1, C), x.reshape(B * T, C)])
    if rows_index is None:
        rows_index = conv_commit_rows(forest, accepted, K, windows).to(x.device)
    new = rows[rows_index].transpose(1, 2)                            # [R, C, K-1]
    if inplace:
        conv_state.copy_(new)
        return conv_state
    return new.contiguous()
