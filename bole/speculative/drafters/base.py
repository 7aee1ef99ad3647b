"""What a drafter is to the round: the two kinds of drafter, what one is built from, and the
description the registry keeps of each.

A **device drafter** grows every row's tree inside the round's draft graph (:class:`TreeGrowth`
calls its step) and keeps its own per-slot state in step with the target's commits. A **host
drafter** proposes continuations from the host (:mod:`~bole.speculative.drafters.host_growth`
builds the trees from them) and the round uploads the trees. The round holds one drafter, chosen
once (:func:`bole.speculative.drafters.registry.build_drafter`), and never asks which one it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, Union, runtime_checkable

from torch import Tensor

from bole.speculative.drafters.host_growth import BatchExpander

__all__ = ["DrafterSetup", "DeviceDrafter", "HostDrafter", "Drafter", "DrafterInfo"]


@dataclass(frozen=True)
class DrafterSetup:
    """What a drafter is built from.

    model:        the target (a :class:`~bole.models.qwen3_hybrid.HybridModel`).
    max_slots:    the target cache's request slots.
    max_len:      the target cache's positions per slot.
    depth, topk:  the round's draft tree shape.
    scratch:      rows past a request's committed tokens that a round writes (tree, path).
    acceptance:   an acceptance profile (drafters that replay one).
    draft_vocab:  the most frequent tokens an MTP head drafts over (0: all).
    draft_model:  a separate draft model (drafters that run one).
    make_runner:  ``(model, cache, gdn_backend) -> ModelRunner``: the engine's model runner, for
                  drafters that run a model of their own (the engine's layer sits above this).
    """

    model: Any
    max_slots: int
    max_len: int
    depth: int
    topk: int
    scratch: int
    acceptance: str | None = None
    draft_vocab: int = 0
    draft_model: Any = None
    make_runner: Callable[..., Any] | None = None


@runtime_checkable
class DeviceDrafter(Protocol):
    """Grows trees on the device, captured in the round's draft graph."""

    on_device: bool             # True

    def start(self, slot: int, prompt: Tensor, continuation: Sequence[int] | None) -> None:
        """A request was admitted into ``slot`` with ``prompt [P]`` (``continuation``: plain
        decoding's known output, for drafters that replay it)."""

    def finish(self, slot: int) -> None:
        """The request in ``slot`` left: drop its state."""

    def step_fn(self, slots: Tensor, ctx: Tensor, topk: int) -> Callable:
        """The tree growth's step for one round over ``slots [R]`` holding ``ctx [R]`` tokens:
        ``step(step_index, frontier [R, K], table) -> (tokens [R, K, topk], probs [R, K, topk])``."""

    def observe_prompts(self, slots: list[int], prompts: list[Tensor],
                        hidden: list[Tensor]) -> None:
        """Eager prefills: prompts ``[P_r]`` and the target's final-norm hidden ``[P_r, H]``."""

    def observe_prompt_rows(self, slots: Tensor, tokens: Tensor, hidden: Tensor,
                            lengths: Tensor) -> None:
        """A batched (captured) prefill's rows: ``tokens [R, T]``, ``hidden [R, T, H]``."""

    def observe_accepted(self, slots: Tensor, tree_tokens: Tensor, path: Tensor,
                         path_global: Tensor, hidden: Tensor, start: Tensor,
                         count: Tensor) -> None:
        """A round committed ``count [R]`` nodes of each row's accepted ``path``."""


@runtime_checkable
class HostDrafter(Protocol):
    """Proposes continuations from the host; the round builds and uploads the trees."""

    on_device: bool             # False

    def start(self, slot: int, prompt: Tensor, continuation: Sequence[int] | None) -> None:
        """As :meth:`DeviceDrafter.start`."""

    def finish(self, slot: int) -> None:
        """As :meth:`DeviceDrafter.finish`."""

    def tree_expander(self, slots: Sequence[int],
                      histories: Sequence[Sequence[int]]) -> BatchExpander:
        """The expander of one round over requests in ``slots`` whose tokens so far (prompt and
        output, ending with the root) are ``histories``."""

    def observe(self, slot: int, tokens: Sequence[int]) -> None:
        """The target committed ``tokens`` (the root, then the accepted drafted tokens)."""


Drafter = Union[DeviceDrafter, HostDrafter]


@dataclass(frozen=True)
class DrafterInfo:
    """A drafter as the registry lists it: its name, its builder and what it needs.

    replays_continuation: it proposes from plain decoding's known output (benchmarks only: a
                          request of a user has no such output), and may force acceptance to it.
    """

    name: str
    build: Callable[[DrafterSetup], Drafter]
    on_device: bool
    help: str
    needs_draft_model: bool = False
    needs_acceptance_profile: bool = False
    replays_continuation: bool = False
    takes_draft_vocab: bool = False
