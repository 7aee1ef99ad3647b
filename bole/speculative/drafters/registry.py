"""Every drafter by name: the one place that knows which drafters exist.

A new drafter is one module that defines its class, a ``build(setup)`` and an ``INFO``
(:class:`~bole.speculative.drafters.base.DrafterInfo`), and one entry in :data:`DRAFTERS`.
Everything else asks the registry what a drafter needs (``drafter_info(name).on_device``...)
instead of comparing names.
"""

from __future__ import annotations

from bole.speculative.drafters import draft_model, mtp, ngram, replay
from bole.speculative.drafters.base import Drafter, DrafterInfo, DrafterSetup

__all__ = ["DRAFTERS", "drafter_names", "drafter_info", "build_drafter", "default_drafter",
           "FALLBACK_DRAFTER"]

#: every drafter, in the order the command line lists them
DRAFTERS: dict[str, DrafterInfo] = {
    info.name: info for info in (ngram.INFO, mtp.INFO, draft_model.INFO, replay.INFO)}

#: the drafter that works for every model without anything loaded
FALLBACK_DRAFTER = ngram.INFO.name


def drafter_names(*, replays: bool = True, draft_model: bool = True) -> tuple[str, ...]:
    """The drafters' names in registry order; ``replays=False`` leaves out those that replay a
    known continuation (not for a user's requests), ``draft_model=False`` those that need a
    separate draft model."""
    return tuple(name for name, d in DRAFTERS.items()
                 if (replays or not d.replays_continuation)
                 and (draft_model or not d.needs_draft_model))


def drafter_info(name: str) -> DrafterInfo:
    """The registry's entry of ``name``; a ValueError naming the drafters for any other."""
    if name not in DRAFTERS:
        raise ValueError(f"drafter must be one of {tuple(DRAFTERS)}, got {name!r}")
    return DRAFTERS[name]


def build_drafter(name: str, setup: DrafterSetup) -> Drafter:
    """The drafter ``name`` built from ``setup`` (chosen once, by the round runner)."""
    return drafter_info(name).build(setup)


def default_drafter(has_mtp_head: bool, has_draft_model: bool = False) -> str:
    """A separate draft model when one is given, else the checkpoint's MTP head when it has one,
    else n-gram lookup."""
    if has_draft_model:
        return draft_model.INFO.name
    return mtp.INFO.name if has_mtp_head else FALLBACK_DRAFTER
