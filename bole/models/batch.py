"""What one fixed-shape forward reads and leaves behind (the model's per-forward context).

A forward runs R requests x T node slots, ``N = R * T`` (:mod:`bole.forest`): decode is T = 1,
verification T = the tree's node slots, a prefill chunk one request with T = the chunk. Every
field is a device tensor or a host constant that the shapes already fix, so a forward built from
static buffers can be captured in a CUDA graph and replayed with new values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bole.forest import DenseForest
from bole.ops.gdn.closed_form import TreeFactors
from bole.tree import ForestMeta

#: How GDN layers verify a tree (the commit follows from it):
#:   triton         Bole: value-tiled closed-form kernel, factors, one cross-layer factored commit
#:   torch          the same closed form in torch (CPU path, oracle)
#:   triton-serial  tree-serial: node-by-node kernel, a state snapshot per node, copy commit
#:   torch-serial   tree-serial semantics in torch (CPU)
#:   triton-decode  plain decoding (T = 1): each row's state updated in place in the pool, no
#:                  commit of GDN state (bole/ops/gdn/decode.py); torch-decode its reference
GDN_BACKENDS = ("torch", "triton", "triton-serial", "torch-serial", "triton-decode",
                "torch-decode")


@dataclass
class ForwardBatch:
    """tokens, positions ``[N]`` int64; slots ``[R]`` int32 pool slots (padding rows: the cache's
    dummy slot); ctx_lens ``[R]`` int64 committed tokens; forest the trees; conv_windows
    ``[N, K]`` conv window codes (:func:`bole.ops.fused.conv_windows_from_parents`).

    ``gdn``: one of :data:`GDN_BACKENDS`. ``meta``: the Triton kernels' forest view (triton
    backends). ``prefill``: ``(slot, committed length)`` as host ints for a prefill chunk (one
    request, a chain, no padding): attention then runs through SDPA over the pool and GDN
    through fla's chunk kernel where it is installed. ``snapshot_store``: per GDN layer a flat
    fp32 buffer the ``triton-serial`` kernel writes its per-node snapshots into (its front
    ``N x H_v x d_k x d_v``), so that the captured forwards of every batch bucket share one
    store rather than each holding its own; None allocates per forward.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    ctx_lens: torch.Tensor
    forest: DenseForest
    conv_windows: torch.Tensor
    gdn: str
    meta: ForestMeta | None = None
    prefill: tuple[int, int] | None = None
    snapshot_store: list[torch.Tensor] | None = None

    @property
    def num_requests(self) -> int:
        return self.forest.num_requests

    @property
    def nodes_per_request(self) -> int:
        return self.forest.nodes_per_request


@dataclass
class ForwardOutput:
    """logits ``[N, V]`` fp32 (None when the caller asked for hidden states only); hidden
    ``[N, H]`` final-norm hidden states (what the lm_head and an MTP head read); per GDN layer
    (in GDN-layer order) what the commit needs."""

    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    conv_inputs: list[torch.Tensor] = field(default_factory=list)       # [N, conv_dim]
    factors: list[TreeFactors] = field(default_factory=list)            # closed-form backends
    snapshots: list[torch.Tensor] = field(default_factory=list)         # serial backends
    final_states: list[torch.Tensor] = field(default_factory=list)      # fla chunk prefill
    #: the closed-form kernel's u, log_decay and k_inv_norm of every GDN layer, written in place
    #: (``[L, N, ...]``; ``factors[i]`` holds views of slice i), so the commit stacks only keys
    factor_store: TreeFactors | None = None
    #: every GDN layer's input projection ``[L, N, P]`` (qwen3.5 layout), written in place by
    #: the projections; ``conv_inputs[i]`` are views of slice i, so the commit reads the conv
    #: inputs of all layers without stacking them
    projection_store: torch.Tensor | None = None
