"""Bole: exact tree speculative decoding for hybrid-attention (Gated DeltaNet) LLMs.

The public API is :class:`bole.LLM` and :class:`bole.SamplingParams` (:mod:`bole.llm`; the one
parameter type of the package, defined in :mod:`bole.sampling_params`). They are imported on
first use, so that ``import bole`` (and the CLI's argument checks) stays free of torch and the
model code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bole.llm import LLM, RequestOutput
    from bole.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "SamplingParams":              # torch-free: no need to load the model code
        from bole.sampling_params import SamplingParams
        return SamplingParams
    if name in __all__:
        from bole import llm
        return getattr(llm, name)
    raise AttributeError(f"module 'bole' has no attribute {name!r}")
