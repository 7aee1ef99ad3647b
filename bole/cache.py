"""Per-request caches addressed by slots: KV for full-attention layers, and the state pools of
the linear-attention layers.

Layouts (one slot per running request, plus one dummy slot that padding rows of a fixed-shape
batch read and write, so that they never touch a request's state):
    k, v        [L_full, S + 1, max_len, H_kv, head_dim]   model dtype
    <pool>      [L, S + 1, *shape]                         per :class:`StatePool`: each
                                                           linear-attention layer type names
                                                           its own (Gated DeltaNet: gdn_state
                                                           [L, S + 1, H_v, d_k, d_v] fp32 and
                                                           conv_state [L, S + 1, conv_dim, K - 1])
    lengths     [S + 1] int64 on the device                committed tokens per slot
A request's KV rows past its committed length are scratch: a forward writes its nodes' keys and
values there and the commit moves the accepted ones into place. ``host_lengths`` mirrors
``lengths`` on the host (the engine learns the accepted counts once per round anyway), so that
nothing has to read the device copy back. A slot is zeroed when allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class CacheFull(RuntimeError):
    """No free slot or no room: the caller queues the request or frees finished ones."""


@dataclass(frozen=True)
class StatePool:
    """A per-slot state pool ``[layers, S + 1, *shape]``, the cache's attribute ``name``;
    ``dtype`` None: the cache's dtype."""

    name: str
    layers: int
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None


@dataclass(frozen=True)
class CacheShape:
    """Full-attention KV layers and heads, and the linear-attention layers' state pools."""

    num_full_layers: int
    num_kv_heads: int
    head_dim: int
    pools: tuple[StatePool, ...] = ()


class HybridCache:
    """Slot-addressed KV and state pools for ``max_slots`` requests."""

    def __init__(self, shape: CacheShape, max_slots: int, max_len: int, *,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"):
        if max_slots < 1 or max_len < 1:
            raise ValueError(f"max_slots and max_len must be >= 1, got {max_slots}, {max_len}")
        self.shape, self.max_slots, self.max_len = shape, max_slots, max_len
        self.dtype, self.device = dtype, torch.device(device)
        s, n = shape, max_slots + 1
        self.k = torch.zeros(s.num_full_layers, n, max_len, s.num_kv_heads, s.head_dim,
                             dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        #: the state pools by name, each also the cache's attribute of that name
        self.pools: dict[str, torch.Tensor] = {}
        for pool in shape.pools:
            if pool.name in self.pools or hasattr(self, pool.name):
                raise ValueError(f"state pool {pool.name!r} is taken: each pool needs a name "
                                 "of its own")
            self.pools[pool.name] = torch.zeros(pool.layers, n, *pool.shape,
                                                dtype=pool.dtype or dtype, device=device)
            setattr(self, pool.name, self.pools[pool.name])
        self.lengths = torch.zeros(n, dtype=torch.int64, device=device)
        self.host_lengths = [0] * n
        # the dummy slot holds one (meaningless) token, so that drafters' "committed length - 1"
        # rows and scratch positions of padding rows stay inside the pools
        self.lengths[max_slots] = 1
        self.host_lengths[max_slots] = 1
        self._free = list(range(max_slots - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def dummy_slot(self) -> int:
        """The slot padding rows of a batch point at; never allocated."""
        return self.max_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> set[int]:
        return set(self._used)

    def allocate(self, tokens_needed: int) -> int:
        """A zeroed slot for a request that will hold at most ``tokens_needed`` tokens (scratch
        for its largest tree included)."""
        if tokens_needed > self.max_len:
            raise CacheFull(
                f"a request needing {tokens_needed} tokens does not fit: each slot holds "
                f"{self.max_len}; shorten the prompt or max tokens, or build a longer cache")
        if not self._free:
            raise CacheFull(f"all {self.max_slots} cache slots are in use; free finished "
                            "requests or queue this one")
        slot = self._free.pop()
        self._used.add(slot)
        self.k[:, slot].zero_()
        self.v[:, slot].zero_()
        for pool in self.pools.values():
            pool[:, slot].zero_()
        self.lengths[slot] = 0
        self.host_lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"slot {slot} is not allocated (double free or never allocated)")
        self._used.remove(slot)
        self._free.append(slot)

    def check_slots(self, slots) -> list[int]:
        slots = [int(s) for s in slots]
        bad = [s for s in slots if s not in self._used]
        if bad:
            raise ValueError(f"slots {bad} are not allocated")
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots {slots} repeat a slot; each request owns one")
        return slots

    def copy_slot(self, src: int, dst: int) -> None:
        """Give slot ``dst`` slot ``src``'s committed state (KV, state pools, lengths):
        benchmarks run a batch whose every request holds the same context."""
        for pool in (self.k, self.v, *self.pools.values()):
            pool[:, dst] = pool[:, src]
        self.lengths[dst] = self.lengths[src]
        self.host_lengths[dst] = self.host_lengths[src]

    def advance(self, slots: list[int], counts: list[int]) -> None:
        """Host mirror of a commit that added ``counts[i]`` tokens to ``slots[i]``."""
        for s, n in zip(slots, counts):
            self.host_lengths[s] += int(n)
