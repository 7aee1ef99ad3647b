"""Admission into the round's slots: batched prefills of short prompts (a CUDA graph per batch
bucket and row width), the drafters' and penalties' upkeep when a request joins or leaves.
:class:`RoundAdmission` is a part of :class:`~bole.engine.round.RoundRunner`."""

from __future__ import annotations

import torch

from bole.engine.buckets import bucket_for
from bole.engine.buffers import PrefillBuffers
from bole.engine.runner import PREFILL_BATCH_MAX, PREFILL_BATCH_ROWS, prefill_bucket
from bole.speculative.penalties import PenaltyCounts

__all__ = ["RoundAdmission"]


class RoundAdmission:
    """Admissions and releases of the round runner's slots."""

    def prefill_widths(self) -> tuple[int, ...]:
        """The row widths of batched admission prefills (:func:`prefill_bucket`'s values below
        a slot's length, as :meth:`ModelRunner.prefill_tokens` pads): each batch bucket's
        prefill is captured at each."""
        widths = {prefill_bucket(n) for n in range(1, PREFILL_BATCH_MAX + 1)}
        return tuple(sorted(T for T in widths if T < self.cache.max_len))

    def _prefill_buffers(self, R: int, T: int) -> PrefillBuffers:
        if (R, T) not in self.prefill_buffers:
            self.prefill_buffers[R, T] = PrefillBuffers(R, T, self.device, self.cache.dummy_slot)
        return self.prefill_buffers[R, T]

    def _prefill(self, R: int, T: int) -> torch.Tensor:
        """Bucket (R, T)'s admission on the device: the target's prefill and commit, the MTP
        head's pool rows; returns the rows' last logits ``[R, V]``."""
        b = self._prefill_buffers(R, T)
        slots = b.slots
        logits, hidden = self.runner.prefill_rows(slots, b.tokens, b.lengths)
        if self.device_drafter is not None:
            self.device_drafter.observe_prompt_rows(slots, b.tokens, hidden, b.lengths)
        return logits

    def prefill(self, slots: list[int], prompts: list[torch.Tensor],
                continuations: list | None = None) -> torch.Tensor:
        """Admit short prompts (``[P_r]``, at most :data:`PREFILL_BATCH_MAX` tokens each) into
        fresh ``slots`` together: one forward of their rows padded to a batch bucket and a
        :func:`prefill_bucket` width, replayed from its CUDA graph (captured at start-up; a
        shape outside them runs eagerly, counted and logged), and the drafters' upkeep.
        Returns each prompt's last logits ``[R, V]`` (on the device). ``continuations``: as
        :meth:`on_prefill`."""
        lengths = [int(p.numel()) for p in prompts]
        if not prompts or len(prompts) != len(slots):
            raise ValueError(f"{len(prompts)} prompts for {len(slots)} slots")
        if len(prompts) > PREFILL_BATCH_ROWS:
            raise ValueError(f"prefill takes at most {PREFILL_BATCH_ROWS} prompts at a time, "
                             f"got {len(prompts)}")
        if min(lengths) < 1 or max(lengths) > PREFILL_BATCH_MAX:
            raise ValueError(f"prefill takes prompts of 1 to {PREFILL_BATCH_MAX} tokens, got "
                             f"lengths {lengths}")
        self.cache.check_slots(slots)
        if any(self.cache.host_lengths[s] for s in slots):
            raise ValueError("prefill fills fresh slots (no committed tokens)")
        tokens = self.runner.prefill_tokens(prompts)
        R, T = bucket_for(len(slots), self.max_slots), tokens.shape[1]
        self._prefill_buffers(R, T).write(list(slots), tokens, lengths)
        logits = self.graphs.run(("prefill", R, T), lambda: self._prefill(R, T))
        self.cache.advance(slots, lengths)
        for slot, prompt, cont in zip(slots, prompts, continuations or [None] * len(slots)):
            self._host_drafters_start(slot, prompt, cont)
        return logits[:len(slots)]

    # ---- the host side of a round ----
    def on_prefill(self, slots: list[int], prompts: list[torch.Tensor],
                   hidden: list[torch.Tensor], continuations: list | None = None) -> None:
        """Requests were prefilled into ``slots`` (prompts ``[P_r]``, final-norm hidden states
        ``[P_r, H]``); ``continuations``: plain decoding's output for each (the replay drafter's
        known future, from its first token on), or None."""
        continuations = continuations or [None] * len(slots)
        if self.device_drafter is not None:
            self.device_drafter.observe_prompts(slots, prompts, hidden)
        for slot, prompt, cont in zip(slots, prompts, continuations):
            self._host_drafters_start(slot, prompt, cont)

    def _host_drafters_start(self, slot: int, prompt: torch.Tensor, continuation) -> None:
        if self.drafter is not None:
            self.drafter.start(slot, prompt, continuation)

    def on_release(self, slot: int) -> None:
        for b in self.buffers.values():         # a later request may reuse the slot: rewrite rows
            b.rows = ()
        if self.drafter is not None:
            self.drafter.finish(slot)

    def start_penalties(self, slot: int, prompt: list[int], first: int) -> None:
        """A penalised request admitted into ``slot`` emitted its ``first`` token: its counts
        start (the per-slot count tensors are made by the first such request)."""
        if self.penalties is None:
            self.penalties = PenaltyCounts(self.cache.max_slots + 1,
                                           self.model.config.vocab_size, self.device)
        self.penalties.start(slot, prompt, first)
