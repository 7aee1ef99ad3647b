"""The interface of a linear-attention layer type (Gated DeltaNet, and whatever comes next).

A hybrid model mixes full-attention layers with layers of one or more linear-attention types,
named by the config's ``layer_types`` entries. Everything that differs between such types lives
in the type's own module under :mod:`bole.models.layers` and nowhere else: the shared code (the
config, the tensor specs and their tensor-parallel slices, the cache, the model's forward, the
runner's commit and prefill) asks the type through the methods below and never names it.

A type is a :class:`LinearAttention` subclass with

* on the class: ``name`` (its ``layer_types`` entry), ``section`` (its name in benchmark
  timings), the tensor-name suffixes kept in fp32 and stored in FP8 by FP8 releases, the
  projections fused at load (:mod:`bole.models.fusion`), and the checkpoint-level methods
  :meth:`parse_config`, :meth:`weight_specs`, :meth:`shard_plan`, :meth:`divisible_counts`,
  :meth:`init_tensor`;
* on an instance (one per model, built from its config, weights and tensor-parallel group):
  the per-slot state pools it keeps in the cache (:meth:`state_pools`), the per-batch inputs
  and per-forward outputs it needs (:meth:`batch_inputs`, :meth:`new_output`), its layer
  :meth:`forward` for decode, prefill and tree verification, and the :meth:`commit` of the
  accepted paths' state.

Every method that runs on a round's path is tensor code without host synchronisation, so the
forwards and commits stay capturable in CUDA graphs.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from bole.cache import StatePool
from bole.distributed import TPShard

__all__ = ["LinearAttention", "Plan", "Shape"]

Shape = tuple[int, ...]
#: a slice of a tensor: the dim it cuts and the [start, stop) ranges concatenated along it
Plan = tuple[int, tuple[tuple[int, int], ...]]


class LinearAttention:
    """One linear-attention layer type of a hybrid model (a subclass per type, see the module)."""

    #: the config's ``layer_types`` entry of this type's layers
    name: ClassVar[str]
    #: the name of its layers' time in :class:`~bole.models.qwen3_hybrid.SectionTimer`
    section: ClassVar[str]
    #: tensor-name suffixes kept in fp32 whatever the load dtype
    fp32_suffixes: ClassVar[tuple[str, ...]] = ()
    #: tensor-name suffixes that FP8 releases store in FP8 (the random ``-fp8`` presets too)
    fp8_projections: ClassVar[tuple[str, ...]] = ()
    #: fused name -> parts, under a layer prefix: projections fused into one weight at load
    fused_groups: ClassVar[dict[str, tuple[str, ...]]] = {}

    # ---- the checkpoint (class level: no model needed) ----
    @classmethod
    def parse_config(cls, text: dict, layers: tuple[int, ...]) -> Any:
        """This type's part of a transformers text config (``text``), for its ``layers``: a
        frozen dataclass with a ``layers`` field and a ``validate()`` method. Its fields read
        as the model config's own (``config.<field>``)."""
        raise NotImplementedError

    @classmethod
    def weight_specs(cls, config, cfg, prefix: str) -> dict[str, Shape]:
        """The checkpoint tensors (name -> shape) of one layer under ``prefix``
        (``{weight_prefix}layers.{i}.``); ``config`` the model's, ``cfg`` this type's."""
        raise NotImplementedError

    @classmethod
    def shard_plan(cls, config, cfg, name: str, shard: TPShard) -> Plan | None:
        """The slice of tensor ``name`` that ``shard`` holds when it is a sliced tensor of this
        type, else None (replicated, or not this type's)."""
        return None

    @classmethod
    def divisible_counts(cls, cfg) -> dict[str, int]:
        """Counts tensor parallelism must split evenly, by what they count (the first is named
        in the error)."""
        return {}

    @classmethod
    def init_tensor(cls, name: str, shape: Shape, device,
                    gen: torch.Generator) -> torch.Tensor | None:
        """Random-weight initialisation of tensor ``name`` where this type wants its own (gates,
        norms), else None (the model's default: small normal, zero vectors)."""
        return None

    # ---- the runtime (one instance per model) ----
    def __init__(self, config, cfg, weights: dict, tp, device: torch.device):
        """``weights``: the model's tensors by name (the same dict, fused in place later)."""
        self.config, self.cfg, self.w, self.tp, self.device = config, cfg, weights, tp, device
        #: decoder layer -> its index among this type's layers (its row in the state pools)
        self.index = {layer: i for i, layer in enumerate(cfg.layers)}

    @property
    def chunked_prefill(self) -> bool:
        """Whether a prefill chunk runs a chunked chain kernel (long chunks pay off)."""
        return False

    def state_pools(self) -> tuple[StatePool, ...]:
        """The per-slot state this type keeps in the cache (this rank's heads); the pool names
        become the cache's attributes."""
        raise NotImplementedError

    def reserve(self, backend: str, max_nodes: int) -> Any:
        """Buffers shared by every forward of a runner over at most ``max_nodes`` nodes (so that
        captured batch buckets share them), or None; handed back to :meth:`batch_inputs`."""
        return None

    def batch_inputs(self, forest, backend: str, reserved: Any) -> Any:
        """What a forward batch over ``forest`` carries for this type (device tensors built
        from the forest only), ``batch.linear[name]``."""
        return None

    def new_output(self) -> Any:
        """An empty record of what a forward leaves for the commit, ``out.linear[name]``."""
        raise NotImplementedError

    def forward(self, layer: int, x: torch.Tensor, cache, batch, out: Any) -> torch.Tensor:
        """Decoder layer ``layer`` over the batch's nodes on top of the committed state (only
        read), leaving in ``out`` what the commit needs; its output summed over the ranks."""
        raise NotImplementedError

    def commit(self, cache, batch, out: Any, slots: torch.Tensor, path_global: torch.Tensor,
               path_len: torch.Tensor, last: torch.Tensor) -> None:
        """Make each request's accepted path its committed state: ``slots [R]`` int64 (the
        batch's), ``path_global [R, P]`` flat node indices, ``path_len [R]`` int64 (0 for
        padding rows, which change nothing), ``last [R]`` each path's last node."""
        raise NotImplementedError
