"""The linear-attention layer types by their config's ``layer_types`` name: the one place that
maps a name to a type (adding a type is its module and one line here)."""

from __future__ import annotations

from bole.models.layers.base import LinearAttention
from bole.models.layers.gdn import GatedDeltaNet

__all__ = ["FULL_ATTENTION", "INTERVAL_LINEAR_TYPE", "LINEAR_ATTENTION_TYPES", "LAYER_TYPES",
           "linear_attention_type"]

#: the ``layer_types`` name of a full-attention layer (the model's own, not a registered type)
FULL_ATTENTION = "full_attention"

#: ``layer_types`` name -> its linear-attention type
LINEAR_ATTENTION_TYPES: dict[str, type[LinearAttention]] = {
    GatedDeltaNet.name: GatedDeltaNet,
}

#: every ``layer_types`` entry a config may hold
LAYER_TYPES = (FULL_ATTENTION, *LINEAR_ATTENTION_TYPES)

#: the layers between full-attention ones of a Qwen config that gives only
#: ``full_attention_interval``, no ``layer_types``
INTERVAL_LINEAR_TYPE = GatedDeltaNet.name


def linear_attention_type(name: str) -> type[LinearAttention]:
    """The type registered under ``name`` (a ValueError naming the registered ones if none)."""
    try:
        return LINEAR_ATTENTION_TYPES[name]
    except KeyError:
        raise ValueError(f"unknown linear-attention layer type {name!r}; known: "
                         f"{', '.join(LINEAR_ATTENTION_TYPES)}") from None
