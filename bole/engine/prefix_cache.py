"""A prefix cache for hybrid state: the KV rows, GDN and conv states (and the MTP head's rows and
hidden state) of committed prompt tokens, kept after a request ends, restored into a new
request's slot when its prompt starts with the same tokens.

Attention layers can resume from any prefix of their KV rows; GDN and conv layers only from a
state taken at that exact position, which cannot be cut out of a longer one. So the cache holds:

    blocks       a trie of ``block``-token edges from the root: each block node holds its tokens'
                 KV rows (every pool's), and optionally the recurrent state at its end
    tails        under a block node (or the root), a checkpoint at a position inside the next
                 block: the KV rows from the block boundary to it and the state there; a prompt
                 of n tokens leaves one at n - 1 (its last token is always computed again, for
                 the logits of the first output token), so a prompt shorter than one block hits
                 when repeated exactly

A lookup walks the trie along the prompt (at most ``n - 1`` tokens) and returns the deepest
checkpoint: the blocks above it and the checkpoint's own rows and state. Restoring copies them
into the request's slot (copy on hit: a running request never reads an entry, so an entry can be
evicted at any time). Entries are evicted least recently used first, leaves before their
parents, when the bytes held pass the capacity; only committed tokens are ever stored, never
speculative nodes.

Pools (:class:`SlotPools`): the target's :class:`~bole.cache.HybridCache` and, when the drafter
is the MTP head, its KV pool and last hidden state (:class:`MTPPools`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from bole.cache import HybridCache

__all__ = ["PrefixCache", "PrefixHit", "SlotPools", "CachePools", "MTPPools", "DEFAULT_BLOCK"]

#: tokens per block: a checkpoint every block along a prompt (where the prefill's chunks end)
DEFAULT_BLOCK = 256


class SlotPools(Protocol):
    """Per-slot state a prefix entry copies: KV-like rows by position, and a recurrent state."""

    def rows(self, slot: int, lo: int, hi: int) -> list[torch.Tensor]:
        """Copies of the rows of positions ``lo:hi``."""

    def put_rows(self, slot: int, lo: int, rows: list[torch.Tensor]) -> None:
        """Write rows taken by :meth:`rows` at positions from ``lo``."""

    def state(self, slot: int) -> list[torch.Tensor]:
        """Copies of the slot's state at its committed length."""

    def put_state(self, slot: int, state: list[torch.Tensor], length: int) -> None:
        """Restore a state taken by :meth:`state` at ``length`` committed tokens."""


class CachePools:
    """The target model's KV rows and state pools (GDN and conv states,
    :class:`~bole.cache.HybridCache`)."""

    def __init__(self, cache: HybridCache):
        self.cache = cache

    def rows(self, slot, lo, hi):
        return [self.cache.k[:, slot, lo:hi].clone(), self.cache.v[:, slot, lo:hi].clone()]

    def put_rows(self, slot, lo, rows):
        k, v = rows
        self.cache.k[:, slot, lo:lo + k.shape[1]] = k
        self.cache.v[:, slot, lo:lo + v.shape[1]] = v

    def state(self, slot):
        return [pool[:, slot].clone() for pool in self.cache.pools.values()]

    def put_state(self, slot, state, length):
        for pool, saved in zip(self.cache.pools.values(), state):
            pool[:, slot] = saved
        self.cache.lengths[slot] = length
        self.cache.host_lengths[slot] = length


class MTPPools:
    """The MTP head's KV rows (row p: position p) and its last hidden state."""

    def __init__(self, drafter):
        self.d = drafter

    def rows(self, slot, lo, hi):
        return [self.d.k[slot, lo:hi].clone(), self.d.v[slot, lo:hi].clone()]

    def put_rows(self, slot, lo, rows):
        k, v = rows
        self.d.k[slot, lo:lo + k.shape[0]] = k
        self.d.v[slot, lo:lo + v.shape[0]] = v

    def state(self, slot):
        return [self.d.last_hidden[slot].clone()]

    def put_state(self, slot, state, length):
        self.d.last_hidden[slot] = state[0]


def _nbytes(tensors: list[list[torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for ts in tensors for t in ts)


@dataclass(eq=False)
class _Node:
    """A block of the trie (``tokens`` of one block) or a tail checkpoint (fewer tokens)."""

    parent: _Node | None
    start: int                                   # position of the first token
    tokens: tuple[int, ...]
    rows: list[list[torch.Tensor]]               # per pool: its rows of these tokens
    state: list[list[torch.Tensor]] | None = None  # per pool: the state at the end
    children: dict = field(default_factory=dict)  # block tokens -> block node
    tails: dict = field(default_factory=dict)     # tail tokens -> tail node
    used: int = 0
    is_tail: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def nbytes(self) -> int:
        return _nbytes(self.rows) + (_nbytes(self.state) if self.state else 0)


@dataclass(frozen=True)
class PrefixHit:
    """A checkpoint at ``length`` tokens: the block nodes above it, then (for a tail) its node."""

    length: int
    path: tuple


class PrefixCache:
    """Blocks and checkpoints of committed prefixes (module docstring), at most
    ``capacity_bytes`` of device memory, over the pools of ``pools`` (the same slots)."""

    def __init__(self, pools: list[SlotPools], capacity_bytes: int, block: int = DEFAULT_BLOCK):
        if block < 1 or capacity_bytes < 0:
            raise ValueError(f"block must be >= 1 and capacity_bytes >= 0, got {block}, "
                             f"{capacity_bytes}")
        self.pools, self.capacity, self.block = list(pools), int(capacity_bytes), block
        self.root = _Node(None, 0, (), [])
        self.bytes = 0
        self._tick = 0
        #: prompt tokens looked up, and of those the tokens restored from the cache
        self.query_tokens = 0
        self.hit_tokens = 0

    # ---- lookup and restore ----
    def lookup(self, tokens: list[int], count: bool = True) -> PrefixHit | None:
        """The deepest checkpoint along ``tokens`` at most ``len(tokens) - 1`` deep, or None.
        ``count``: :meth:`record` the query and the hit (False: a look that changes nothing)."""
        limit = len(tokens) - 1
        node, path, best = self.root, [], None
        candidates = [(self.root, ())]
        while node.end + self.block <= limit:
            child = node.children.get(tuple(tokens[node.end:node.end + self.block]))
            if child is None:
                break
            path.append(child)
            node = child
            candidates.append((child, tuple(path)))
            if child.state is not None:
                best = PrefixHit(child.end, tuple(path))
        for at, above in candidates:
            for tt, tail in at.tails.items():
                end = at.end + len(tt)
                if end <= limit and (best is None or end > best.length) and \
                        tuple(tokens[at.end:end]) == tt:
                    best = PrefixHit(end, above + (tail,))
        if count:
            self.record(tokens, best)
        return best

    def record(self, tokens: list[int], hit: PrefixHit | None) -> None:
        """Count the query of ``tokens`` (every token but the last) and its ``hit`` (a
        :meth:`lookup` without counting), and mark the hit's entries used."""
        self.query_tokens += max(len(tokens) - 1, 0)
        if hit is not None:
            self.hit_tokens += hit.length
            self._tick += 1
            for n in hit.path:
                n.used = self._tick

    def restore(self, hit: PrefixHit, slot: int) -> None:
        """Copy a hit's rows and state into ``slot`` (a fresh one), which then holds
        ``hit.length`` committed tokens."""
        for n in hit.path:
            for pool, rows in zip(self.pools, n.rows):
                pool.put_rows(slot, n.start, rows)
        last = hit.path[-1]
        for pool, state in zip(self.pools, last.state):
            pool.put_state(slot, state, hit.length)

    # ---- insertion ----
    def states(self, slot: int) -> list[list[torch.Tensor]]:
        """Every pool's state of ``slot`` now (a checkpoint at its committed length)."""
        return [p.state(slot) for p in self.pools]

    def insert(self, tokens: list[int], slot: int,
               checkpoints: dict[int, list[list[torch.Tensor]]]) -> None:
        """Record ``slot``'s committed ``tokens``: the blocks up to the deepest checkpoint not
        held yet (their rows copied from the slot, which must still hold those positions) and,
        for each ``position: states`` of ``checkpoints`` (:meth:`states` taken when the slot
        held exactly ``position`` tokens), a checkpoint there: on the block ending at it, or a
        tail."""
        if not checkpoints:
            return
        deepest = max(checkpoints)
        if min(checkpoints) < 1 or deepest > len(tokens):
            raise ValueError(f"checkpoints at {sorted(checkpoints)} for {len(tokens)} tokens")
        self._tick += 1
        node = self.root
        while True:
            if node.end in checkpoints and node is not self.root and node.state is None:
                node.state = checkpoints[node.end]
                self.bytes += _nbytes(node.state)
            for pos in checkpoints:
                if node.end < pos < node.end + self.block:
                    self._add_tail(node, tokens, slot, pos, checkpoints[pos])
            node.used = self._tick
            if node.end + self.block > deepest:
                break
            key = tuple(tokens[node.end:node.end + self.block])
            child = node.children.get(key)
            if child is None:
                child = _Node(node, node.end, key,
                              [p.rows(slot, node.end, node.end + self.block) for p in self.pools])
                node.children[key] = child
                self.bytes += child.nbytes()
            node = child
        self.evict()

    def _add_tail(self, node: _Node, tokens: list[int], slot: int, pos: int,
                  states: list[list[torch.Tensor]]) -> None:
        key = tuple(tokens[node.end:pos])
        tail = node.tails.get(key)
        if tail is None:
            tail = _Node(node, node.end, key, [p.rows(slot, node.end, pos) for p in self.pools],
                         states, is_tail=True)
            node.tails[key] = tail
            self.bytes += tail.nbytes()
        tail.used = self._tick

    # ---- eviction ----
    def _leaves(self, node: _Node):
        """Evictable entries under ``node``: tails, states of blocks, blocks with nothing below."""
        for tail in node.tails.values():
            yield tail
        for child in node.children.values():
            yield from self._leaves(child)
            if child.state is not None:
                yield ("state", child)
            if not child.children and not child.tails and child.state is None:
                yield child

    def evict(self, target: int | None = None) -> int:
        """Drop least recently used entries until at most ``target`` bytes (the capacity) are
        held; returns the bytes freed."""
        target = self.capacity if target is None else target
        freed = 0
        while self.bytes > target:
            entries = list(self._leaves(self.root))
            if not entries:
                break
            victim = min(entries, key=lambda e: e[1].used if isinstance(e, tuple) else e.used)
            if isinstance(victim, tuple):
                node = victim[1]
                size = _nbytes(node.state)
                node.state = None
            elif victim.is_tail:
                size = victim.nbytes()
                del victim.parent.tails[victim.tokens]
            else:
                size = victim.nbytes()
                del victim.parent.children[victim.tokens]
            self.bytes -= size
            freed += size
        return freed

    def clear(self) -> None:
        self.evict(0)

    def stats(self) -> dict:
        """What the cache holds: blocks, checkpoints (block states and tails), tokens, bytes."""
        blocks = states = tails = tokens = 0
        stack = [self.root]
        while stack:
            n = stack.pop()
            tails += len(n.tails)
            tokens += sum(len(t) for t in n.tails)
            for c in n.children.values():
                blocks += 1
                states += c.state is not None
                tokens += len(c.tokens)
                stack.append(c)
        return dict(blocks=blocks, block_states=states, tails=tails, tokens=tokens,
                    bytes=self.bytes, capacity_bytes=self.capacity,
                    query_tokens=self.query_tokens, hit_tokens=self.hit_tokens)
