"""What one fixed-shape forward reads and leaves behind (the model's per-forward context).

A forward runs R requests x T node slots, ``N = R * T`` (:mod:`bole.forest`): decode is T = 1,
verification T = the tree's node slots, a prefill chunk one request with T = the chunk. Every
field is a device tensor or a host constant that the shapes already fix, so a forward built from
static buffers can be captured in a CUDA graph and replayed with new values. What a
linear-attention layer type reads and leaves is its own record, under its ``layer_types`` name
(:mod:`bole.models.layers`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from bole.forest import DenseForest
from bole.tree import ForestMeta

#: How linear-attention layers verify a tree (the commit follows from it); every layer type
#: runs each of them:
#:   triton         Bole: value-tiled closed-form kernel, factors, one cross-layer factored commit
#:   torch          the same closed form in torch (CPU path, oracle)
#:   triton-serial  tree-serial: node-by-node kernel, a state snapshot per node, copy commit
#:   torch-serial   tree-serial semantics in torch (CPU)
#:   triton-decode  plain decoding (T = 1): each row's state updated in place in the pool, no
#:                  commit of the recurrent state (Gated DeltaNet: bole/ops/gdn/decode.py);
#:                  torch-decode its reference
BACKENDS = ("torch", "triton", "triton-serial", "torch-serial", "triton-decode", "torch-decode")


@dataclass
class ForwardBatch:
    """tokens, positions ``[N]`` int64; slots ``[R]`` int32 pool slots (padding rows: the cache's
    dummy slot); ctx_lens ``[R]`` int64 committed tokens; forest the trees.

    ``backend``: one of :data:`BACKENDS`. ``linear``: per linear-attention layer type (by name)
    what its layers read besides (:meth:`~bole.models.layers.base.LinearAttention.batch_inputs`:
    Gated DeltaNet's conv windows, its snapshot store). ``meta``: the Triton kernels' forest
    view (triton backends). ``prefill``: ``(slot, committed length)`` as host ints for a prefill
    chunk (one request, a chain, no padding): attention then runs through SDPA over the pool and
    a linear-attention type through its chunked kernel where it has one.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    ctx_lens: torch.Tensor
    forest: DenseForest
    backend: str
    linear: dict[str, Any] = field(default_factory=dict)
    meta: ForestMeta | None = None
    prefill: tuple[int, int] | None = None

    @property
    def num_requests(self) -> int:
        return self.forest.num_requests

    @property
    def nodes_per_request(self) -> int:
        return self.forest.nodes_per_request


@dataclass
class ForwardOutput:
    """logits ``[N, V]`` fp32 (None when the caller asked for hidden states only); hidden
    ``[N, H]`` final-norm hidden states (what the lm_head and an MTP head read); ``linear``: per
    linear-attention layer type (by name) what its commit needs
    (:meth:`~bole.models.layers.base.LinearAttention.new_output`)."""

    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    linear: dict[str, Any] = field(default_factory=dict)
