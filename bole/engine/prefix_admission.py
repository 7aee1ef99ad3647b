"""Admission through the prefix cache (:mod:`bole.engine.prefix_cache`): restore the longest
cached prefix of a prompt into the request's slot, prefill only the rest, and leave checkpoints
for the requests after it.

    admit     lookup -> restore (KV rows, GDN and conv states, the MTP head's rows and hidden
              state) -> prefill of the suffix, its chunks ending at every block boundary and at
              the prompt's last token but one, where the target's state is taken -> the
              drafters' upkeep of the suffix -> insert (blocks and checkpoints). Requests with
              at most 64 tokens to prefill go together: all but their last tokens in batched
              rows (the batched admission's CUDA graphs for prompts the cache does not hold,
              one eager forward for the rests of hits), then one forward takes every last
              token
    finish    a request that ends normally leaves a checkpoint at its committed length (a later
              turn of a chat starts with this prompt and its answer)

Only committed tokens reach the cache. A restored slot holds the rows and states a prefill of
the prefix writes, equal to rounding (the cache moves where a prefill's chunks end, and the
closed form sums in another order over other chunks), and the suffix runs the same prefill. The
draft model drafter (its own cache) prefills the whole prompt as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from bole.engine.prefix_cache import CachePools, MTPPools, PrefixCache
from bole.engine.runner import (PREFILL_BATCH_MAX, PREFILL_CHUNK_FLA, PREFILL_CHUNK_TREE,
                                prefill_bucket)
from bole.speculative.drafters.mtp import MTPDrafter

__all__ = ["PrefixCacheConfig", "PrefixAdmission", "default_capacity_bytes"]

GIB = 1 << 30


@dataclass(frozen=True)
class PrefixCacheConfig:
    """``capacity_gib``: device memory the cache may hold (None: :func:`default_capacity_bytes`);
    ``block``: tokens per block (a checkpoint of the recurrent state at each block boundary);
    None: the prefill's chunk (1,024 tokens with fla on a GPU, 64 otherwise), so that a
    checkpoint costs no chunk the prefill would not run anyway. ``min_prompt_tokens``: shorter
    prompts are admitted as without the cache (no lookup, no checkpoint at admission); None:
    on a GPU the prompts the batched admission takes (up to 64 tokens), whose one captured
    forward for many prompts beats a restore and a prefill of the rest request by request, on
    the CPU, where compute dominates, none (2). A finished request is recorded whatever its
    prompt's length (a later turn of its chat is longer)."""

    capacity_gib: float | None = None
    block: int | None = None
    min_prompt_tokens: int | None = None

    def __post_init__(self):
        if self.capacity_gib is not None and self.capacity_gib < 0:
            raise ValueError(f"prefix cache capacity must be >= 0 GiB, got {self.capacity_gib}")
        if self.block is not None and self.block < 1:
            raise ValueError(f"prefix cache block must be >= 1 token, got {self.block}")
        if self.min_prompt_tokens is not None and self.min_prompt_tokens < 2:
            raise ValueError(f"prefix cache min_prompt_tokens must be >= 2 (a prompt of one "
                             f"token has no prefix to restore), got {self.min_prompt_tokens}")


def default_capacity_bytes(device: torch.device) -> int:
    """A tenth of the GPU's memory, at most 16 GiB (what is free after the engine's pools is
    not known this early); 1 GiB on the CPU."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return int(min(16 * GIB, total // 10))
    return GIB


class PrefixAdmission:
    """The prefix cache of one engine: its store over the target's cache (and the MTP head's
    pools when it drafts), and admission and finish through it."""

    def __init__(self, engine, config: PrefixCacheConfig):
        self.engine = engine
        self.config = config
        #: the device drafter (the MTP head, or the replay drafter around it): its observe
        #: keeps the head's pools, which the cache holds too
        self.mtp = engine.rounds.device_drafter
        pools = [CachePools(engine.cache)]
        if self.mtp is not None:
            head = self.mtp if isinstance(self.mtp, MTPDrafter) else self.mtp.mtp
            pools.append(MTPPools(head))
        capacity = default_capacity_bytes(engine.model.device) if config.capacity_gib is None \
            else int(config.capacity_gib * GIB)
        self.block = config.block or (PREFILL_CHUNK_FLA if engine.model.chunked_prefill
                                      else PREFILL_CHUNK_TREE)
        self.store = PrefixCache(pools, capacity, self.block)
        #: prompts shorter than this are admitted as without the cache
        self.min_prompt_tokens = config.min_prompt_tokens or (
            PREFILL_BATCH_MAX + 1 if engine.model.device.type == "cuda" else 2)

    def takes(self, r) -> bool:
        """Whether request ``r`` is admitted through the cache (its prompt is long enough)."""
        return len(r.prompt) >= self.min_prompt_tokens

    def admit(self, requests: list) -> torch.Tensor:
        """Fill each request's fresh slot with its prompt (restoring what the cache holds);
        returns the last prompt tokens' logits ``[R, V]``; sets each ``r.cached_tokens``.
        Requests with a long prefill go first, one by one (:meth:`_admit_one`), so that the
        others can hit what they leave; then those with at most PREFILL_BATCH_MAX tokens left
        to prefill go together (:meth:`_admit_batched`)."""
        logits = {}
        for r in requests:
            hit = self.store.lookup(list(r.prompt), count=False)
            if not self._batches(r, hit):
                self.store.record(list(r.prompt), hit)
                logits[id(r)] = self._admit_one(r, hit)
        rest = [r for r in requests if id(r) not in logits]
        hits = {id(r): self.store.lookup(list(r.prompt)) for r in rest}
        batched = [r for r in rest if self._batches(r, hits[id(r)])]
        if batched:
            logits.update(zip(map(id, batched), self._admit_batched(batched, hits)))
        for r in rest:                   # an entry evicted meanwhile: a long prefill after all
            if id(r) not in logits:
                logits[id(r)] = self._admit_one(r, hits[id(r)])
        return torch.stack([logits[id(r)] for r in requests])

    def _batches(self, r, hit) -> bool:
        """Whether ``r`` is admitted with others: a prompt of 2 to PREFILL_BATCH_MAX tokens the
        cache does not hold, or a hit with at most PREFILL_BATCH_MAX tokens after it (whose
        padded rows stay inside the slot)."""
        n = len(r.prompt)
        if hit is None:
            return 2 <= n <= PREFILL_BATCH_MAX
        rest = n - 1 - hit.length
        return rest < PREFILL_BATCH_MAX and \
            (rest == 0 or hit.length + prefill_bucket(rest) < self.engine.cache.max_len)

    def _admit_batched(self, requests: list, hits: dict) -> torch.Tensor:
        """Requests with at most PREFILL_BATCH_MAX tokens to prefill: the hits restored, then
        all but every prompt's last token in two forwards (the prompts the cache does not hold
        through the batched admission and its CUDA graphs, the rest of the hits in one forward
        of their rows), a checkpoint each at its last token but one, then every last token in
        one forward. Returns their logits ``[R, V]``."""
        e, rounds = self.engine, self.engine.rounds
        fresh = [r for r in requests if hits[id(r)] is None]
        if fresh:
            rounds.prefill([r.slot for r in fresh],
                           [torch.tensor(list(r.prompt[:-1])) for r in fresh],
                           [r.continuation for r in fresh])
        start = {id(r): 0 if hits[id(r)] is None else hits[id(r)].length for r in requests}
        for r in requests:
            if hits[id(r)] is not None:
                self.store.restore(hits[id(r)], r.slot)
        self._prefill_rest([r for r in requests if hits[id(r)] is not None
                            and start[id(r)] < len(r.prompt) - 1], start)
        for r in requests:
            r.cached_tokens = start[id(r)]
            if start[id(r)] < len(r.prompt) - 1:
                self._insert(list(r.prompt), r.slot, {
                    len(r.prompt) - 1: self._safely(lambda: self.store.states(r.slot))})
        tokens = torch.tensor([r.prompt[-1] for r in requests])
        out = e.runner.decode_output([r.slot for r in requests], tokens)
        self._continue_drafters(requests, tokens[:, None], out.hidden[:, None],
                                [len(r.prompt) - 1 for r in requests])
        return out.logits

    def _prefill_rest(self, requests: list, start: dict) -> None:
        """Restored slots holding ``start[id(r)]`` tokens: commit each prompt's tokens from
        there up to its last but one in one forward of rows padded to a
        :func:`~bole.engine.runner.prefill_bucket` width (eager; one forward a width, so
        that no padded row reaches past its slot), and the MTP head's rows of them."""
        widths: dict[int, list] = {}
        for r in requests:
            widths.setdefault(prefill_bucket(len(r.prompt) - 1 - start[id(r)]), []).append(r)
        for width, group in widths.items():
            self._prefill_rows(group, start, width)

    def _prefill_rows(self, requests: list, start: dict, width: int) -> None:
        e = self.engine
        rest = [torch.tensor(list(r.prompt[start[id(r)]:-1])) for r in requests]
        lengths = [int(t.numel()) for t in rest]
        dev = e.runner.device
        tokens = e.runner.prefill_tokens(rest, width).to(dev)
        slots = torch.tensor([r.slot for r in requests], dtype=torch.int32, device=dev)
        counts = torch.tensor(lengths, device=dev)
        _, hidden = e.runner.prefill_rows(slots, tokens, counts)
        e.cache.advance([r.slot for r in requests], lengths)
        if self.mtp is not None:
            self.mtp.observe(slots, tokens, hidden,
                             torch.tensor([start[id(r)] for r in requests], device=dev), counts)

    def _admit_one(self, r, hit) -> torch.Tensor:
        """One request: restore ``hit`` (None: nothing), prefill the rest with checkpoints at
        block boundaries and at the prompt's last token but one. Returns its logits ``[V]``."""
        e, slot, prompt = self.engine, r.slot, list(r.prompt)
        h = 0
        if hit is not None:
            self.store.restore(hit, slot)
            h = hit.length
        r.cached_tokens = h
        n, block = len(prompt), self.block
        points = {p for p in range(block, n, block) if p > h} | ({n - 1} if n - 1 > h else set())
        target = {}
        pool = self.store.pools[0]
        suffix = torch.tensor(prompt[h:])
        last, hidden = e.runner.prefill(
            slot, suffix, on_chunk=e.on_prefill_chunk, checkpoints=sorted(points),
            on_checkpoint=lambda p: target.__setitem__(p, self._safely(lambda: pool.state(slot))))
        self._drafters_observe(r, h, suffix, hidden)
        # the head's state at p: the hidden state of token p - 1, the last one committed
        checkpoints = {p: [s] + ([[hidden[p - 1 - h].clone()]] if self.mtp is not None else [])
                       for p, s in target.items() if s is not None}
        self._insert(prompt, slot, checkpoints)
        return last

    def _drafters_observe(self, r, h: int, suffix: torch.Tensor, hidden: torch.Tensor) -> None:
        """The drafters' upkeep of a prefill: as a fresh prompt's, or after a restored prefix
        as a continuation (:meth:`_continue_drafters`)."""
        if h == 0 or self.mtp is None:
            self.engine.rounds.on_prefill([r.slot], [torch.tensor(list(r.prompt))], [hidden],
                                          [r.continuation])
        else:
            self._continue_drafters([r], suffix[None], hidden[None], [h])

    def _continue_drafters(self, requests: list, tokens: torch.Tensor, hidden: torch.Tensor,
                           starts: list[int]) -> None:
        """Requests whose slots held ``starts[i]`` tokens committed ``tokens [R, P]`` (final-norm
        ``hidden [R, P, H]``): the MTP head observes them from its restored or earlier hidden
        state, and the drafters start again from each whole prompt."""
        dev, R = hidden.device, len(requests)
        if self.mtp is not None:
            self.mtp.observe(torch.tensor([r.slot for r in requests], dtype=torch.int32,
                                          device=dev),
                             tokens.to(dev), hidden, torch.tensor(starts, device=dev),
                             torch.full((R,), tokens.shape[1], dtype=torch.int64, device=dev))
        drafter = self.engine.rounds.drafter
        if drafter is not None:
            for r in requests:
                drafter.start(r.slot, torch.tensor(list(r.prompt)), r.continuation)

    def finish(self, r) -> None:
        """A request ends: a checkpoint at its committed length (its prompt and the answer so
        far, the pending last token excluded) when that passes its prompt."""
        slot = r.slot
        length = self.engine.cache.host_lengths[slot]
        tokens = list(r.prompt) + list(r.out)
        if len(r.prompt) < length <= len(tokens):
            self._insert(tokens[:length], slot,
                         {length: self._safely(lambda: self.store.states(slot))})

    def _safely(self, fn):
        """``fn()``, or None where the device ran out of memory: the cache's capacity is then
        halved (the engine's own pools were sized first; a request never fails for the cache)."""
        try:
            return fn()
        except torch.OutOfMemoryError:
            self.store.capacity = self.store.bytes // 2
            self.store.evict()
            logging.getLogger("bole").warning(
                "the prefix cache ran out of device memory: its capacity is now %.2f GiB "
                "(set --prefix-cache-gib lower to avoid this)", self.store.capacity / GIB)
            return None

    def _insert(self, tokens: list[int], slot: int, checkpoints: dict) -> None:
        checkpoints = {p: s for p, s in checkpoints.items() if s is not None}
        self._safely(lambda: self.store.insert(tokens, slot, checkpoints))

    def stats(self) -> dict:
        return self.store.stats()
