"""The replay drafter: a real MTP head's cost with a documented acceptance profile.

Random-weight presets (Qwen3.5-9B / 27B) give real cost but no acceptance. The replay drafter runs
a real MTP head of the preset's size (:class:`bole.speculative.drafters.mtp.MTPDrafter` over random weights),
so that drafting costs what it would, and then *replaces* the head's proposals with tokens that make
the target accept as an :class:`AcceptanceProfile` says. The target still verifies every token, so
greedy output stays exactly plain decoding's.

The model (greedy verification; Sequoia's positional acceptance vector, arXiv 2402.12374):

* The target's greedy continuation is known in advance: the caller runs plain decoding once and
  hands each request's tokens to :meth:`ReplayDrafter.set_continuation`. They live in a device
  buffer ``continuation [max_slots + 1, max_len + 1]`` (the extra row is the cache's dummy slot,
  the extra column a position past the cache); -1 marks a position without a known token.
* A tree's root sits at position ``ctx`` (the request's committed length) and is always on the
  target's path; a node at depth d sits at ``ctx + d`` and is *on path* iff every node on its path
  from the root (itself included) holds the continuation's token at its position.
* An on-path frontier node's proposals hold the true next token (``continuation[ctx + d + 1]``) at
  rank i (1-based) with probability ``p_i = profile.rank_acceptance[i - 1]``, at no rank with
  probability ``1 - sum(p_1 .. p_topk)``: one categorical draw per node. Every other proposal is
  a wrong token: distinct from its siblings and never the true one.
* Off-path nodes, and nodes whose next position has no known token, get distinct arbitrary tokens
  that also avoid the continuation's token at their position. So the only proposals that ever
  hold the continuation's token are the drawn ones of on-path nodes, and a node is on path iff it
  is the root or holds the continuation's token at its own position (by induction over depth: an
  off-path parent never proposes it). The step tests just that, no ancestor walk.
* The reported draft probability of the rank-i proposal is ``q_i = min(p_1, .., p_i)`` (0 for ranks
  past the profile), whatever the node: the non-increasing envelope of the profile, equal to
  ``p_i`` itself when the profile is non-increasing (both shipped ones are). The growth's rho of a
  node is then the product of its ranks' ``q``: the profile's estimate of the probability that the
  target accepts the whole path (Sequoia's model: independent draws per node), which is what budget
  policies rank nodes by; the sum of a tree's rho is its expected tokens per round.

Randomness is a counter-based hash on the device of (seed, the request's stream key, ``ctx``, the
node's id): an on-path node's id is its depth (there is one on-path node per depth), an off-path
node's its slot in the growth's node table. So a node's draw depends neither on the batch it runs in
(its row, its slot, its neighbours) nor on the verification mode: every mode sees the same trees for
the same seed, and a chain (top-1) draws at its on-path nodes exactly what a tree draws at the same
depths. Everything in :meth:`ReplayDrafter.step_fn` is fixed-shape tensor code without host
synchronisation (CUDA-graph capturable, like the MTP step it wraps). On CUDA each step adds one
launch to the head's step (:mod:`bole.ops.replay.kernel`, which hashes every node's key
itself); the torch code (CPU, or ``BOLE_REPLAY_KERNEL=0``) hashes the round's keys once, at step
0, and adds about thirty small element-wise operations a step.

The replay models greedy verification: with sampling the target's tokens are not the greedy
continuation, and where a request's output leaves its continuation (bf16 near-ties) every later
node is off path and acceptance falls to what arbitrary tokens get. Output stays exact either way.

Profiles ship as JSON files under ``bole/speculative/profiles/`` (``bundled``, ``qwen3-next-mtp``);
any JSON file of the same form can be passed by path::

    {"name": "...", "source": "where the numbers come from (required, non-empty)",
     "rank_acceptance": [p_1, p_2, ...],     # each in [0, 1], sum <= 1, non-empty
     "notes": "...", ...}                    # optional; other keys (a measurement record) ignored
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from bole.speculative.drafters import mtp
from bole.speculative.drafters.base import DrafterInfo, DrafterSetup
from bole.speculative.drafters.mtp import MTPDrafter
from bole.speculative.tree_growth import NodeTable, TreeGrowth

__all__ = ["AcceptanceProfile", "ReplayDrafter", "PROFILE_DIR", "SHIPPED_PROFILES",
           "chain_accept_length"]

PROFILE_DIR = Path(__file__).parents[1] / "profiles"
#: profiles shipped with Bole, loadable by name
SHIPPED_PROFILES = ("bundled", "qwen3-next-mtp")
#: rounding slack allowed on ``sum(rank_acceptance) <= 1``
SUM_TOLERANCE = 1e-9
#: widest top-k the draft probabilities are prepared for (the engine allows 16)
MAX_TOPK = 64


# ---------------------------------------------------------------- acceptance profiles

def chain_accept_length(p1: float, steps: int) -> float:
    """Expected tokens per round of a chain of ``steps`` top-1 drafts whose every draft is accepted
    with probability ``p1`` given its parent was: ``1 + p1 + p1**2 + .. + p1**steps`` (the 1 is
    the target's own token at the first rejection or after the last draft)."""
    return 1.0 + sum(p1 ** d for d in range(1, steps + 1))


def _check_profile(name: Any, source: Any, ranks: Any, origin: str) -> tuple[float, ...]:
    """Validate a profile's fields; returns the acceptance vector as floats. ``origin`` names the
    file (or object) in every error."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{origin}: 'name' must be a non-empty string, got {name!r}")
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"{origin}: missing 'source': every acceptance profile must say where "
                         f"its numbers come from (a non-empty string), got {source!r}")
    if not isinstance(ranks, (list, tuple)) or len(ranks) == 0:
        raise ValueError(f"{origin}: 'rank_acceptance' must be a non-empty list of probabilities "
                         f"p_1, p_2, .. (rank i's draft is the target's token), got {ranks!r}")
    values = []
    for i, p in enumerate(ranks, start=1):
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p):
            raise ValueError(f"{origin}: rank_acceptance[{i - 1}] (p_{i}) must be a finite "
                             f"number, got {p!r}")
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{origin}: rank_acceptance[{i - 1}] (p_{i}) = {p} lies outside "
                             f"[0, 1]")
        values.append(float(p))
    total = math.fsum(values)
    if total > 1.0 + SUM_TOLERANCE:
        raise ValueError(f"{origin}: rank_acceptance sums to {total:.12g} > 1; at most one rank "
                         f"holds the target's token, so the p_i must sum to at most 1")
    return tuple(values)


@dataclass(frozen=True)
class AcceptanceProfile:
    """Sequoia's positional acceptance vector of a drafter at greedy verification.

    rank_acceptance: ``(p_1, .., p_k)``: ``p_i`` is the probability that the drafter's rank-i
    proposal at an on-path node is the target's greedy token (ranks 1-based; ``sum p_i <= 1``;
    ranks past k never hold it). ``source`` says where the numbers come from; ``notes`` how they
    were derived. Validated on construction (``ValueError`` naming the problem).
    """

    name: str
    source: str
    rank_acceptance: tuple[float, ...]
    notes: str = ""

    def __post_init__(self) -> None:
        ranks = _check_profile(self.name, self.source, self.rank_acceptance,
                               f"acceptance profile {self.name!r}")
        object.__setattr__(self, "rank_acceptance", ranks)

    @property
    def ranks(self) -> int:
        """k: the number of ranks the profile gives."""
        return len(self.rank_acceptance)

    def draft_probs(self, topk: int) -> tuple[float, ...]:
        """The draft probability reported for ranks 1..topk: ``q_i = min(p_1, .., p_i)`` (the
        non-increasing envelope, so proposals come in descending probability), 0 past rank k."""
        out, low = [], 1.0
        for i in range(topk):
            low = min(low, self.rank_acceptance[i]) if i < self.ranks else 0.0
            out.append(low)
        return tuple(out)

    def chain_accept_length(self, steps: int) -> float:
        """Expected tokens per round of a top-1 chain of ``steps`` drafts under this profile."""
        return chain_accept_length(self.rank_acceptance[0], steps)

    def tree_accept_length(self, depth: int, topk: int, budget: int) -> float:
        """Expected tokens per round of the replay drafter's tree of this shape (EAGLE-2 growth
        of ``depth`` steps, top-``topk``, ``budget`` nodes with the root) at greedy verification:
        the sum of the kept nodes' rho. A node is on the target's path with probability the
        product of its ranks' p_i (one independent draw per node), which is its rho when the
        profile is non-increasing (``q == p``); the root counts the target's own token."""
        probs = torch.tensor(self.draft_probs(topk), dtype=torch.float32)

        def step(_: int, frontier: Tensor, table: NodeTable) -> tuple[Tensor, Tensor]:
            R, K = frontier.shape            # distinct dummy tokens: only the shape matters
            return torch.arange(topk).expand(R, K, topk), probs.expand(R, K, topk)
        forest = TreeGrowth(1, topk, depth, budget).grow(torch.zeros(1, dtype=torch.int64),
                                                         torch.tensor([depth]), step)
        return float(forest.rho.sum())

    def to_dict(self) -> dict:
        return dict(name=self.name, source=self.source,
                    rank_acceptance=list(self.rank_acceptance), notes=self.notes)

    @classmethod
    def from_dict(cls, data: Any, origin: str = "acceptance profile") -> "AcceptanceProfile":
        """A profile from a parsed JSON object; ``origin`` (e.g. the file) is named in errors.
        ``name`` defaults to ``origin`` (:meth:`load`: to the file's stem); keys other than
        name/source/rank_acceptance/notes are ignored (a measurement record may ride along)."""
        if not isinstance(data, dict):
            raise ValueError(f"{origin}: an acceptance profile must be a JSON object, got "
                             f"{type(data).__name__}")
        name = data.get("name", origin)
        ranks = _check_profile(name, data.get("source"), data.get("rank_acceptance"), origin)
        notes = data.get("notes", "")
        if not isinstance(notes, str):
            raise ValueError(f"{origin}: 'notes' must be a string, got {type(notes).__name__}")
        return cls(name, data["source"], ranks, notes)

    @classmethod
    def load(cls, name_or_path: "str | Path") -> "AcceptanceProfile":
        """A shipped profile by name (``"bundled"``, ``"qwen3-next-mtp"``) or a JSON file by
        path. ``ValueError`` for an unknown name, a missing or unreadable file, malformed JSON or
        invalid contents, naming the file and the problem."""
        key = str(name_or_path)
        if key in SHIPPED_PROFILES:
            path = PROFILE_DIR / f"{key}.json"
        else:
            path = Path(key)
            if not path.is_file():
                raise ValueError(f"unknown acceptance profile {key!r}: give one of "
                                 f"{', '.join(SHIPPED_PROFILES)} or the path of a JSON file "
                                 f"(no file at {path})")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"acceptance profile {path}: not valid JSON ({e})") from None
        except OSError as e:
            raise ValueError(f"acceptance profile {path}: cannot be read ({e})") from None
        if isinstance(data, dict) and "name" not in data:
            data = {**data, "name": path.stem}
        return cls.from_dict(data, origin=f"acceptance profile {path}")


# ---------------------------------------------------------------- device hashing

_M31 = 0x7FFFFFFF


def _fmix31(x):
    """A murmur3-style finaliser on ``[0, 2**31)`` (a Python int or an int64 tensor): xor-shifts
    and multiplications by odd 31-bit constants, each a bijection; products stay below ``2**62``,
    so int64 never overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x05EBCA6B) & _M31
    x = x ^ (x >> 13)
    x = (x * 0x42B2AE35) & _M31
    return x ^ (x >> 16)


def _combine(h, x):
    """Hash of the pair (h, x), both in ``[0, 2**31)``."""
    return _fmix31(h ^ _fmix31(x))


def _stream_key(tokens: Sequence[int], start: int) -> int:
    """A request's default stream key: a CRC of where its continuation starts and its tokens, so
    that the same request draws the same trees in any slot, batch and mode."""
    values = [start, *tokens]
    return zlib.crc32(struct.pack(f"<{len(values)}q", *values)) & _M31


# ---------------------------------------------------------------- the drafter

class ReplayDrafter:
    """An MTP head's drafting cost with an acceptance profile's proposals.

    A drop-in for :class:`MTPDrafter` in the round: :meth:`step_fn` has its signature and
    contract, and :meth:`observe`, :meth:`observe_prompt` and :meth:`reset` keep the wrapped
    head's pool in step with the target exactly as the head's own methods do (so its cost stays
    a real head's). On top, :meth:`set_continuation` gives a slot the target's greedy tokens.

    mtp:       the head whose steps run for their cost (random weights are fine).
    profile:   the acceptance to replay.
    max_slots: the cache's slots (the continuation buffer has one more row: the dummy slot).
    max_len:   the cache's positions per slot.
    seed:      the replay's seed: with the same seed every mode and batch sees the same trees.
    """

    on_device = True

    def __init__(self, mtp: MTPDrafter, profile: AcceptanceProfile, max_slots: int,
                 max_len: int, seed: int = 0):
        if max_slots < 1 or max_len < 1:
            raise ValueError(f"max_slots and max_len must be >= 1, got {max_slots}, {max_len}")
        self.mtp, self.profile = mtp, profile
        self.max_slots, self.max_len = max_slots, max_len
        self.seed = int(seed)
        self.vocab = mtp.model.config.vocab_size
        dev = self.device = mtp.k.device
        #: [max_slots + 1, max_len + 1] int64: the target's token at each position, -1 unknown;
        #: the last column stays -1 and answers every position past the cache
        self.continuation = torch.full((max_slots + 1, max_len + 1), -1, dtype=torch.int64,
                                       device=dev)
        #: [max_slots + 1] int64 in [0, 2**31): each slot's stream key (see set_continuation)
        self.stream = torch.arange(max_slots + 1, dtype=torch.int64, device=dev)
        #: [k] float64: cumulative p_1 .. p_k; a uniform u lands at rank sum(u >= cum)
        self.cum = torch.tensor([math.fsum(profile.rank_acceptance[:i + 1])
                                 for i in range(profile.ranks)], dtype=torch.float64, device=dev)
        #: [max(k, MAX_TOPK)] float32: q_i, sliced to the round's top-k on the device
        self.q = torch.tensor(profile.draft_probs(max(profile.ranks, MAX_TOPK)),
                              dtype=torch.float32, device=dev)
        self._seed_key = _combine(0x5EED5EED, self.seed & _M31)

    @property
    def width(self) -> int:
        """Columns of the continuation buffer: ``max_len`` positions and one past them."""
        return self.max_len + 1

    # ---- the host side: admission and release ----
    def set_continuation(self, slot: int, tokens: Sequence[int], start: int,
                         request: int | None = None) -> None:
        """The target's greedy tokens for positions ``start, start + 1, ..`` of ``slot``; every
        other position of the slot becomes unknown (-1). Tokens past ``max_len`` are dropped.

        Call it at admission, after the slot is allocated and before the slot's first round:
        ``start`` is the prompt length (the position of the first generated token) and
        ``tokens`` plain decoding's output from its first token on. ``request`` fixes the slot's
        stream key; by default it is a hash of (start, tokens), so that a request draws the same
        trees whatever slot, batch or mode it runs in. Host call (one upload)."""
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot must lie in [0, {self.max_slots}) (the dummy slot keeps no "
                             f"continuation), got {slot}")
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        tokens = [int(t) for t in tokens]
        if any(not 0 <= t < self.vocab for t in tokens):
            raise ValueError(f"continuation tokens must lie in [0, {self.vocab})")
        row = torch.full((self.width,), -1, dtype=torch.int64)
        n = max(0, min(len(tokens), self.max_len - start))
        row[start:start + n] = torch.tensor(tokens[:n], dtype=torch.int64)
        self.continuation[slot].copy_(row)
        key = _stream_key(tokens, start) if request is None else int(request) & _M31
        self.stream[slot] = key

    def forced_targets(self, slots: Tensor, ctx: Tensor, depth: Tensor) -> Tensor:
        """``[R, T]`` int64: the continuation's token after each node (a node at depth d of a
        round whose root sits at position ``ctx[r]`` is followed by position ctx + d + 1), -1
        where unknown. Device code (captured with the acceptance)."""
        return self._lookup(slots.long() * self.width, ctx.long()[:, None] + depth + 1)

    def clear(self, slot: int) -> None:
        """Forget a slot's continuation (at release): all its positions become unknown."""
        self.continuation[slot].fill_(-1)
        self.stream[slot] = slot

    # ---- the wrapped head's pool upkeep (what MTPDrafter's callers call) ----
    def observe(self, slots: Tensor, tokens: Tensor, hidden: Tensor, start: Tensor,
                count: Tensor) -> None:
        """:meth:`MTPDrafter.observe` of the wrapped head."""
        self.mtp.observe(slots, tokens, hidden, start, count)

    def observe_accepted(self, slots: Tensor, tree_tokens: Tensor, path: Tensor,
                         path_global: Tensor, hidden: Tensor, start: Tensor,
                         count: Tensor) -> None:
        """:meth:`MTPDrafter.observe_accepted` of the wrapped head."""
        self.mtp.observe_accepted(slots, tree_tokens, path, path_global, hidden, start, count)

    def observe_prompt(self, slot: int, tokens: Tensor, hidden: Tensor) -> None:
        """:meth:`MTPDrafter.observe_prompt` of the wrapped head."""
        self.mtp.observe_prompt(slot, tokens, hidden)

    def observe_prompts(self, slots: list[int], prompts: list[Tensor],
                        hidden: list[Tensor]) -> None:
        """:meth:`MTPDrafter.observe_prompts` of the wrapped head."""
        self.mtp.observe_prompts(slots, prompts, hidden)

    def observe_prompt_rows(self, slots: Tensor, tokens: Tensor, hidden: Tensor,
                            lengths: Tensor) -> None:
        """:meth:`MTPDrafter.observe_prompt_rows` of the wrapped head."""
        self.mtp.observe_prompt_rows(slots, tokens, hidden, lengths)

    def reset(self, slot: int) -> None:
        """:meth:`MTPDrafter.reset` of the wrapped head, and :meth:`clear`."""
        self.mtp.reset(slot)
        self.clear(slot)

    def start(self, slot: int, prompt: Tensor, continuation: Sequence[int] | None) -> None:
        """The slot's continuation: plain decoding's output after ``prompt [P]``."""
        self.set_continuation(slot, continuation or [], start=prompt.numel())

    def finish(self, slot: int) -> None:
        self.reset(slot)

    # ---- drafting ----
    def step_fn(self, slots: Tensor, ctx: Tensor, topk: int) -> Callable:
        """The tree growth's drafter step for one round over ``slots [R]`` (int32) whose targets
        hold ``ctx [R]`` committed tokens: :meth:`MTPDrafter.step_fn`'s contract. Each call runs
        the head's real step (its cost, its pool writes), then returns the replayed
        ``tokens [R, K, topk]`` int64 and ``probs [R, K, topk]`` float32 instead of the head's."""
        if not 1 <= topk < self.vocab or topk > self.q.numel():
            raise ValueError(f"topk must lie in [1, {min(self.vocab - 1, self.q.numel())}] for "
                             f"the replay drafter (vocabulary {self.vocab}), got {topk}")
        head_step = self.mtp.step_fn(slots, ctx, topk)
        slots_l, ctx = slots.long(), ctx.to(torch.int64)
        row = slots_l * self.width                         # [R] flat offset of each row's slot
        state: dict[str, Tensor] = {}

        def step(step_index: int, frontier: Tensor, table: NodeTable) -> tuple[Tensor, Tensor]:
            head_step(step_index, frontier, table)           # the real head's cost, discarded
            if frontier.device.type == "cuda" and \
                    os.environ.get("BOLE_REPLAY_KERNEL", "1") != "0":
                from bole.ops.replay.kernel import propose_triton      # one launch
                tokens = propose_triton(self.continuation, row, ctx, self.stream, slots_l,
                                        self._seed_key, frontier, table.tokens, table.depth,
                                        self.cum, topk, self.vocab, self.max_len)
                return tokens, self.q[:topk].expand(*frontier.shape, topk)
            if "keys" not in state:                          # once per round (inside its graph)
                state["keys"] = self._round_keys(slots_l, ctx, table.capacity)
            return self._propose(row, ctx, state["keys"], frontier, table, topk)
        return step

    def _round_keys(self, slots_l: Tensor, ctx: Tensor, capacity: int) -> Tensor:
        """``[R, 2 * capacity]`` int64 in ``[0, 2**31)``: the hash of (seed, stream key, ctx,
        node id) for every node id of the round: ids ``0 .. capacity - 1`` are the on-path node
        of that depth, ``capacity + c`` the off-path node in table slot c."""
        head = _combine(_combine(self._seed_key, self.stream[slots_l]), ctx & _M31)     # [R]
        ids = torch.arange(2 * capacity, dtype=torch.int64, device=ctx.device)
        return _combine(head[:, None], _fmix31(ids))

    def _lookup(self, row: Tensor, positions: Tensor) -> Tensor:
        """``continuation`` of each row's slot at ``positions [R, K]`` (-1 unknown or past the
        cache: positions beyond it read the buffer's last, always -1, column)."""
        return torch.take(self.continuation, row[:, None] + positions.clamp(max=self.max_len))

    @torch.no_grad()
    def _propose(self, row: Tensor, ctx: Tensor, keys: Tensor, frontier: Tensor,
                 table: NodeTable, topk: int) -> tuple[Tensor, Tensor]:
        """The replayed proposals of ``frontier [R, K]`` (slots of ``table``, -1 for none):
        ``tokens [R, K, topk]`` int64 and ``probs [R, K, topk]`` float32 (``q`` per rank).
        Rows of -1 frontier entries hold arbitrary (valid) values, which the growth ignores.
        ``keys``: :meth:`_round_keys`. This is the torch code (the reference): on CUDA the step
        of :meth:`step_fn` runs one Triton launch instead (:mod:`bole.ops.replay.kernel`,
        which hashes the keys itself; ``BOLE_REPLAY_KERNEL=0`` keeps this code there)."""
        R, K = frontier.shape
        C = table.capacity
        f = frontier.clamp(min=0)
        depth = torch.gather(table.depth, 1, f)
        position = ctx[:, None] + depth                                           # [R, K]
        here = self._lookup(row, position)
        nxt = self._lookup(row, position + 1)          # the target's token after the node
        # on path: the root, or holding the continuation's token (see the module docstring)
        on_path = (depth == 0) | (torch.gather(table.tokens, 1, f) == here)
        key = torch.gather(keys, 1, torch.where(on_path, depth, C + f))            # [R, K]
        # which rank holds the true token: 0 .. k-1, or k (none); ranks >= topk hold it never
        hit = (key.to(torch.float64)[..., None] * 2.0 ** -31 >= self.cum).sum(-1)
        # wrong tokens: topk consecutive ids (mod V) from a hashed base; past a known next token
        # they start after it and stop short of it again, so none equals it
        known = nxt >= 0
        base = torch.where(known, nxt + 1 + key % (self.vocab - topk), key % self.vocab)
        rank = torch.arange(topk, device=frontier.device)
        tokens = (base[..., None] + rank) % self.vocab                           # [R, K, topk]
        put = (on_path & known)[..., None] & (rank == hit[..., None])
        tokens = torch.where(put, nxt[..., None], tokens)
        return tokens, self.q[:topk].expand(R, K, topk)


def build(setup: DrafterSetup) -> ReplayDrafter:
    """The real head runs for its cost; its proposals are replaced by the profile's."""
    return ReplayDrafter(mtp.build(setup), AcceptanceProfile.load(setup.acceptance),
                         setup.max_slots, setup.max_len)


INFO = DrafterInfo("replay", build, on_device=True, takes_draft_vocab=True,
                   needs_acceptance_profile=True, replays_continuation=True,
                   help="an acceptance profile replayed at an MTP head's cost (benchmarks)")
