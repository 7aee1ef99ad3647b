"""Drafters: what proposes a node's continuations. Each gives an :data:`Expander` for one request.

Implemented here: n-gram prompt lookup (no model). The MTP head and the separate draft model need
the model runtime's drafting forward and come with the engine.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from bole.spec.draft_tree import BatchExpander, Expander, top_k_per_request


class NgramDrafter:
    """Prompt lookup: continue the longest recent n-gram (``max_n`` down to ``min_n`` tokens)
    that already occurred in the request's context; candidates are the tokens that followed it,
    scored by their share of those occurrences (the most recent wins ties)."""

    def __init__(self, max_n: int = 4, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def lookup(self, context: Sequence[int], k: int) -> list[tuple[int, float]]:
        ctx = list(context)
        for n in range(min(self.max_n, len(ctx) - 1), self.min_n - 1, -1):
            suffix = ctx[-n:]
            follow: Counter[int] = Counter()
            last_seen: dict[int, int] = {}
            for j in range(len(ctx) - n):
                if ctx[j:j + n] == suffix:
                    tok = ctx[j + n]
                    follow[tok] += 1
                    last_seen[tok] = j
            if follow:
                total = sum(follow.values())
                best = sorted(follow, key=lambda t: (-follow[t], -last_seen[t]))[:k]
                return [(t, follow[t] / total) for t in best]
        return []

    def expander(self, history: Sequence[int]) -> Expander:
        """``history`` ends with the root token (the last emitted one)."""
        before = list(history[:-1])

        def expand(paths, k):
            return [self.lookup(before + list(path), k) for path in paths]
        return expand


class DraftModelDrafter:
    """A separate (smaller) hybrid model drafting for the target, with its own cache slots.

    Its committed state follows the target's: the prompt at prefill, the accepted path after every
    round (:meth:`observe`). Expanding frontier nodes runs one tree forward over the trie of their
    paths on top of the committed state, so every node gets the GDN state after its own ancestors
    (the draft model's own per-node states, exactly).
    """

    def __init__(self, draft_model, target_vocab: int, max_slots: int, max_len: int):
        if draft_model.config.vocab_size != target_vocab:
            raise ValueError(
                f"the draft model's vocabulary ({draft_model.config.vocab_size}) differs from the "
                f"target's ({target_vocab}); drafter and target must share a tokenizer")
        self.model = draft_model
        self.cache = draft_model.new_cache(max_slots, max_len)
        self.slots: dict[int, int] = {}

    def start(self, target_slot: int, prompt: Sequence[int]) -> None:
        import torch
        if target_slot in self.slots:
            self.cache.free(self.slots.pop(target_slot))
        slot = self.cache.allocate(self.cache.max_len)
        self.slots[target_slot] = slot
        self.model.prefill(self.cache, slot, torch.tensor(list(prompt)))

    def finish(self, target_slot: int) -> None:
        if target_slot in self.slots:
            self.cache.free(self.slots.pop(target_slot))

    def observe(self, target_slot: int, tokens: Sequence[int]) -> None:
        """The target committed ``tokens`` (root .. accepted): commit them here too."""
        import torch
        from bole.tree import DraftTree, PackedForest
        slot = self.slots[target_slot]
        out = self.model.forward_tree(self.cache, [slot], PackedForest.pack(
            [DraftTree.chain(len(tokens))]), torch.tensor(list(tokens)))
        self.model.commit(self.cache, out, [len(tokens) - 1])

    def batch_expander(self, target_slots: Sequence[int]) -> BatchExpander:
        """One tree forward of the draft model per call, over the tries of every request's paths
        (each request on its own slot, so each node gets the state after its own ancestors)."""
        import torch
        from bole.tree import DraftTree, PackedForest
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
            out = self.model.forward_tree(self.cache, [slots[i] for i in live], forest,
                                          torch.tensor(tokens))
            rows = [int(forest.cu_nodes[j]) + index[j][tuple(int(t) for t in path)]
                    for j, i in enumerate(live) for path in paths_per_request[i]]
            return top_k_per_request(out.logits[rows], paths_per_request, k)
        return expand_batch

    def expander(self, target_slot: int) -> Expander:
        """Expander for one request (the batch expander over ``[target_slot]``)."""
        batch = self.batch_expander([target_slot])

        def expand(paths, k):
            return batch([paths], k)[0] if paths else []
        return expand
