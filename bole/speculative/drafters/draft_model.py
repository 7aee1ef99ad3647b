"""A separate (smaller) draft model as a host tree drafter, driving a model runner of its own."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from bole.speculative.drafters.base import DrafterInfo, DrafterSetup
from bole.speculative.drafters.host_growth import BatchExpander, Expander, top_k_per_request
from bole.tree import DraftTree, PackedForest


class DraftModelDrafter:
    """A separate (smaller) hybrid model drafting for the target, with its own cache slots.

    Its committed state follows the target's: the prompt at prefill, the accepted path after every
    round (:meth:`observe`). Expanding frontier nodes runs one tree forward over the trie of their
    paths on top of the committed state, so every node gets the GDN state after its own ancestors
    (the draft model's own per-node states, exactly). It drafts from the host: its forwards run
    eagerly, outside the round's CUDA graphs. ``make_runner(model, cache, gdn_backend)`` builds
    its model runner (the engine's :class:`~bole.engine.runner.ModelRunner`).
    """

    on_device = False

    def __init__(self, draft_model, target_vocab: int, max_slots: int, max_len: int,
                 scratch: int = 0, *, make_runner: Callable):
        if draft_model.config.vocab_size != target_vocab:
            raise ValueError(
                f"the draft model's vocabulary ({draft_model.config.vocab_size}) differs from the "
                f"target's ({target_vocab}); drafter and target must share a tokenizer")
        self.model = draft_model
        # a trie of frontier paths holds at most the whole drafted tree
        self.scratch = max(scratch, 64)
        self.cache = draft_model.new_cache(max_slots, max_len + self.scratch)
        self.runner = make_runner(draft_model, self.cache, draft_model.gdn_backend)
        self.slots: dict[int, int] = {}

    def start(self, target_slot: int, prompt: Sequence[int] | torch.Tensor,
              continuation: Sequence[int] | None = None) -> None:
        """Prefill ``prompt`` into a slot of the draft model's own cache."""
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if target_slot in self.slots:
            self.cache.free(self.slots.pop(target_slot))
        slot = self.cache.allocate(self.cache.max_len)
        self.slots[target_slot] = slot
        self.runner.prefill(slot, torch.tensor(list(prompt)))

    def finish(self, target_slot: int) -> None:
        if target_slot in self.slots:
            self.cache.free(self.slots.pop(target_slot))

    def observe(self, target_slot: int, tokens: Sequence[int]) -> None:
        """The target committed ``tokens`` (root .. accepted): commit them here too."""
        slot = self.slots[target_slot]
        batch, out = self.runner.verify([slot], PackedForest.pack([DraftTree.chain(len(tokens))]),
                                        torch.tensor(list(tokens)))
        self.runner.commit_accepted(batch, out, [len(tokens) - 1])

    def batch_expander(self, target_slots: Sequence[int]) -> BatchExpander:
        """One tree forward of the draft model per call, over the tries of every request's paths
        (each request on its own slot, so each node gets the state after its own ancestors)."""
        slots = [self.slots[t] for t in target_slots]

        def expand_batch(paths_per_request, k):
            live = [i for i, paths in enumerate(paths_per_request) if paths]
            if not live:
                return [[] for _ in paths_per_request]
            trees, tokens, index = [], [], []
            for i in live:
                trie: dict[tuple[int, ...], int] = {}
                parents, toks = [], []
                for path in paths_per_request[i]:
                    for d in range(1, len(path) + 1):
                        key = tuple(int(t) for t in path[:d])
                        if key not in trie:
                            trie[key] = len(parents)
                            parents.append(trie[key[:-1]] if d > 1 else -1)
                            toks.append(key[-1])
                trees.append(DraftTree.from_parents(parents))
                index.append(trie)
                tokens.extend(toks)
            forest = PackedForest.pack(trees)
            batch, out = self.runner.verify([slots[i] for i in live], forest, torch.tensor(tokens))
            T = batch.nodes_per_request
            rows = [j * T + index[j][tuple(int(t) for t in path)]
                    for j, i in enumerate(live) for path in paths_per_request[i]]
            return top_k_per_request(out.logits[rows], paths_per_request, k)
        return expand_batch

    def expander(self, target_slot: int) -> Expander:
        """Expander for one request (the batch expander over ``[target_slot]``)."""
        batch = self.batch_expander([target_slot])

        def expand(paths, k):
            return batch([paths], k)[0] if paths else []
        return expand

    def tree_expander(self, slots: Sequence[int],
                      histories: Sequence[Sequence[int]]) -> BatchExpander:
        """:meth:`batch_expander` over ``slots`` (the draft model holds the histories itself)."""
        return self.batch_expander(slots)


def build(setup: DrafterSetup) -> DraftModelDrafter:
    return DraftModelDrafter(setup.draft_model, setup.model.config.vocab_size, setup.max_slots,
                             setup.max_len, scratch=setup.scratch, make_runner=setup.make_runner)


INFO = DrafterInfo("draft", build, on_device=False, needs_draft_model=True,
                   help="a separate draft model (the target's tokenizer)")
