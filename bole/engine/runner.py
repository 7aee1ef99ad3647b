"""The model runner: fixed-shape forward batches over the cache, the commit, and prefill.

The model (:class:`bole.models.qwen3_hybrid.HybridModel`) is layers only; the runner owns what
surrounds a forward: building its :class:`ForwardBatch` from device tensors (forest structure,
positions, the kernels' forest view, each linear-attention layer type's inputs), committing the
accepted paths into the cache (KV rows moved into place, each linear-attention type's state by
its own commit, lengths), and chunked prefill. Everything on the round's path is tensor code without host synchronisation,
so that :mod:`bole.engine.graphs` can capture it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bole.cache import HybridCache
from bole.forest import DenseForest
from bole.models.batch import BACKENDS, ForwardBatch, ForwardOutput
from bole.models.qwen3_hybrid import HybridModel
from bole.ops.commit_rows import move_kv_rows

#: prefill chunk: long chunks where chunked kernels run the linear-attention layers (fla's, on
#: the GPU), short ones where the tree path does (its cost grows with the chunk squared)
PREFILL_CHUNK_FLA = 1024
PREFILL_CHUNK_TREE = 64
#: prompts up to this many tokens are prefilled together, one row each, by the tree path
PREFILL_BATCH_MAX = 64
#: rows of one batched admission prefill: more arrivals go in groups of this many (bounds the
#: captured admission forwards' memory at 16 x 64 tokens)
PREFILL_BATCH_ROWS = 16


def prefill_bucket(n: int) -> int:
    """The row width of a batched prefill of prompts up to ``n`` tokens: a power of two from
    16 to :data:`PREFILL_BATCH_MAX`."""
    return min(PREFILL_BATCH_MAX, max(16, 1 << (n - 1).bit_length()))


class ModelRunner:
    """Forward batches and commits of one model over one cache, with one backend (``gdn``) for
    its linear-attention layers."""

    def __init__(self, model: HybridModel, cache: HybridCache, gdn: str):
        if gdn not in BACKENDS:
            raise ValueError(f"gdn must be one of {BACKENDS}, got {gdn!r}")
        if gdn.startswith("triton") and model.device.type != "cuda":
            from bole.ops.triton_utils import check_kernel_device
            check_kernel_device(model.device, f"gdn={gdn!r}")
        self.model, self.cache, self.gdn = model, cache, gdn
        self.device = model.device
        #: per linear-attention type, what :meth:`reserve_snapshots` reserved for it
        self.reserved: dict[str, object] = {}

    def reserve_snapshots(self, max_nodes: int) -> None:
        """Buffers of ``max_nodes`` nodes that each linear-attention type shares among every
        forward of this runner, and so among every captured batch bucket (the ``triton-serial``
        backend's per-node state snapshots): without them each bucket's graph keeps its own
        alive, and a batch that fits alone runs out of memory beside its smaller buckets."""
        self.reserved = {kind: t.reserve(self.gdn, max_nodes)
                         for kind, t in self.model.linear.items()}

    # ---- batches ----
    def make_batch(self, tokens: torch.Tensor, forest: DenseForest, slots: torch.Tensor,
                   gdn: str | None = None, prefill: tuple[int, int] | None = None) -> ForwardBatch:
        """A forward batch over ``forest`` (R x T node slots) from device tensors only:
        ``tokens [R * T]`` int64, ``slots [R]`` int32 (padding rows: the cache's dummy slot)."""
        gdn = gdn or self.gdn
        slots = slots.to(torch.int32)
        ctx = self.cache.lengths[slots.long()]
        linear = {kind: t.batch_inputs(forest, gdn, self.reserved.get(kind))
                  for kind, t in self.model.linear.items()}
        meta = forest.kernel_meta() if gdn.startswith("triton") else None
        return ForwardBatch(tokens=tokens, positions=forest.positions(ctx), slots=slots,
                            ctx_lens=ctx, forest=forest, backend=gdn, linear=linear,
                            meta=meta, prefill=prefill)

    def forward(self, batch: ForwardBatch, *, logits: bool = True) -> ForwardOutput:
        return self.model.forward(self.cache, batch, logits=logits)

    # ---- the commit ----
    def commit(self, batch: ForwardBatch, out: ForwardOutput, path: torch.Tensor,
               path_len: torch.Tensor, *, kv_in_place: bool = False) -> torch.Tensor:
        """Make each request's accepted path its new committed state; returns the paths as
        flat node indices ``[R, P]`` (what a drafter's own commit reads).

        ``path [R, P]`` local node indices root first (padded past ``path_len``), ``path_len
        [R]``: 0 for padding rows, which change nothing. ``kv_in_place``: the accepted nodes'
        KV already sit at their final rows (chains: decode and prefill)."""
        cache, forest = self.cache, batch.forest
        slots = batch.slots.long()
        path_len = path_len.to(torch.int64)
        if not kv_in_place and cache.k.shape[0]:
            move_kv_rows(cache.k, cache.v, slots, batch.ctx_lens, path, path_len)
        path_global = forest.global_index(path)
        last = torch.gather(path_global, 1, (path_len - 1).clamp(min=0)[:, None])[:, 0]
        for kind, t in self.model.linear.items():
            t.commit(cache, batch, out.linear[kind], slots, path_global, path_len, last)
        cache.lengths.index_add_(0, slots, path_len)
        return path_global

    # ---- prefill ----
    def prefill(self, slot: int, prompt: torch.Tensor, chunk: int | None = None,
                on_chunk=None, checkpoints: Sequence[int] = (),
                on_checkpoint=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Commit ``prompt [P]`` into ``slot`` (after the tokens it holds) chunk by chunk;
        returns the last token's logits ``[V]`` and every token's final-norm hidden state
        ``[P, H]``.

        Linear attention runs its chunked kernel where it has one (fla's on a GPU where
        installed), else the closed form over each chunk (whatever the runner's backend: a
        prefill's state is the same in every mode).
        ``on_chunk(done, total)`` reports progress. ``checkpoints``: committed lengths at which
        a chunk also ends, ``on_checkpoint(length)`` called there with the slot's state at
        exactly that length (the prefix cache's snapshots)."""
        if prompt.dim() != 1 or prompt.numel() == 0:
            raise ValueError("prompt must be a non-empty 1-D tensor of token ids")
        self._check_tokens(prompt)
        end = self.cache.host_lengths[slot] + prompt.numel()
        if end > self.cache.max_len:
            raise ValueError(f"the prompt would reach position {end - 1}, past the cache's "
                             f"{self.cache.max_len} tokens per slot")
        long_chunks = self.model.chunked_prefill
        chunk = chunk or (PREFILL_CHUNK_FLA if long_chunks else PREFILL_CHUNK_TREE)
        gdn = "triton" if self.device.type == "cuda" else "torch"
        tokens = prompt.to(self.device)
        hidden, logits = [], None
        slot_t = torch.tensor([slot], dtype=torch.int32, device=self.device)
        P = prompt.numel()
        start = self.cache.host_lengths[slot]
        cuts = set(range(chunk, P, chunk)) | {c - start for c in checkpoints
                                              if start < c < start + P}
        bounds = [0, *sorted(cuts), P]
        for lo, hi in zip(bounds, bounds[1:]):
            part = tokens[lo:hi]
            T = part.numel()
            forest = DenseForest.chain(1, T, self.device)
            batch = self.make_batch(part, forest, slot_t, gdn,
                                    prefill=(slot, self.cache.host_lengths[slot]))
            out = self.model.forward(self.cache, batch, logits=False)
            path = torch.arange(T, device=self.device)[None]
            self.commit(batch, out, path, torch.tensor([T], device=self.device), kv_in_place=True)
            self.cache.advance([slot], [T])
            hidden.append(out.hidden)
            if hi == P:
                logits = self.model.lm_head(out.hidden[-1:])[0]
            if on_checkpoint is not None and start + hi in checkpoints:
                on_checkpoint(start + hi)
            if on_chunk is not None:
                on_chunk(hi, P)
        return logits, torch.cat(hidden)

    def prefill_batch(self, slots: list[int],
                      prompts: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Commit several short prompts (at most :data:`PREFILL_BATCH_MAX` tokens each) into
        fresh ``slots`` in one forward: one chain per row, padded to :func:`prefill_bucket` of the
        longest, linear attention by the
        closed form (the verify path). Returns each prompt's last logits ``[R, V]`` and its
        final-norm hidden states (``[P_r, H]`` each). Equal to :meth:`prefill` of each alone."""
        slots = self.cache.check_slots(slots)
        if len(prompts) != len(slots) or not prompts:
            raise ValueError(f"{len(prompts)} prompts for {len(slots)} slots")
        lengths = [int(p.numel()) for p in prompts]
        if min(lengths) < 1 or max(lengths) > PREFILL_BATCH_MAX:
            raise ValueError(f"prefill_batch takes prompts of 1 to {PREFILL_BATCH_MAX} tokens, "
                             f"got lengths {lengths}")
        if any(self.cache.host_lengths[s] for s in slots):
            raise ValueError("prefill_batch fills fresh slots (no committed tokens)")
        tokens = self.prefill_tokens(prompts)
        dev = self.device
        length_t = torch.tensor(lengths, device=dev)
        slot_t = torch.tensor(slots, dtype=torch.int32, device=dev)
        logits, hidden = self.prefill_rows(slot_t, tokens.to(dev), length_t)
        self.cache.advance(slots, lengths)
        return logits, [hidden[r, :n] for r, n in enumerate(lengths)]

    def prefill_tokens(self, prompts: list[torch.Tensor], width: int | None = None) -> torch.Tensor:
        """Host ``[R, T]`` int64 rows of short prompts, zero-padded to ``width`` (default: the
        :func:`prefill_bucket` of the longest, below a slot's length: padding rows run on the
        dummy slot, which holds a token; a few shapes, compiled or captured once each), token
        ids checked."""
        longest = max(int(p.numel()) for p in prompts)
        T = width or max(longest, min(prefill_bucket(longest), self.cache.max_len - 1))
        tokens = torch.zeros(len(prompts), T, dtype=torch.int64)
        for r, p in enumerate(prompts):
            tokens[r, :p.numel()] = p
        self._check_tokens(tokens)
        return tokens

    def prefill_rows(self, slots: torch.Tensor, tokens: torch.Tensor,
                     lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The device part of :meth:`prefill_batch` (no checks, no host bookkeeping, no host
        synchronisation: capturable): row r commits ``tokens[r, :lengths[r]]`` into fresh slot
        ``slots[r]`` as one chain. ``slots [R]`` int32, ``tokens [R, T]`` int64, ``lengths [R]``
        int64; a row of length 0 (padding: the cache's dummy slot) commits nothing. Returns
        each row's last logits ``[R, V]`` and the final-norm hidden states ``[R, T, H]``."""
        R, T = tokens.shape
        dev = tokens.device
        node = torch.arange(T, device=dev)
        valid = node[None, :] < lengths.clamp(min=1)[:, None]
        forest = DenseForest.from_parents((node - 1).expand(R, T).contiguous(), valid, T - 1)
        gdn = "triton" if dev.type == "cuda" else "torch"
        batch = self.make_batch(tokens.reshape(-1), forest, slots, gdn)
        out = self.model.forward(self.cache, batch, logits=False)
        self.commit(batch, out, node.expand(R, T), lengths, kv_in_place=True)
        hidden = out.hidden.view(R, T, -1)
        last = hidden[torch.arange(R, device=dev), (lengths - 1).clamp(min=0)]
        return self.model.lm_head(last), hidden

    # ---- one-off forwards (tests, the draft-model drafter) ----
    def verify(self, slots: list[int], trees, tokens: torch.Tensor,
               nodes_per_request: int | None = None) -> tuple[ForwardBatch, ForwardOutput]:
        """Eager forward of host-built trees (a :class:`bole.tree.PackedForest`) with
        ``tokens`` in packed order; returns the batch and its output (dense row order)."""
        slots = self.cache.check_slots(slots)
        forest = DenseForest.from_packed(trees, nodes_per_request, device=self.device)
        R, T = forest.parents.shape
        need = max(self.cache.host_lengths[s] for s in slots) + max(T, forest.max_depth + 1)
        if need > self.cache.max_len:
            raise ValueError(f"the trees would reach position {need - 1}, past the cache's "
                             f"{self.cache.max_len} tokens per slot")
        self._check_tokens(tokens)
        dense = torch.zeros(R * T, dtype=torch.int64)
        sizes = trees.sizes().tolist()
        for r, n in enumerate(sizes):
            lo = int(trees.cu_nodes[r])
            dense[r * T: r * T + n] = tokens[lo:lo + n].cpu()
        slot_t = torch.tensor(slots, dtype=torch.int32, device=self.device)
        batch = self.make_batch(dense.to(self.device), forest, slot_t)
        return batch, self.forward(batch)

    def commit_accepted(self, batch: ForwardBatch, out: ForwardOutput, accepted) -> list[int]:
        """Commit host-chosen accepted nodes (local indices); returns the path lengths."""
        acc = torch.as_tensor(list(accepted), dtype=torch.int64, device=self.device)
        path, path_len = batch.forest.paths(acc)
        self.commit(batch, out, path, path_len)
        lengths = path_len.tolist()
        self.cache.advance(batch.slots.tolist(), lengths)
        return lengths

    def _check_tokens(self, tokens: torch.Tensor) -> None:
        vocab = self.model.config.vocab_size
        if bool(((tokens < 0) | (tokens >= vocab)).any()):
            raise ValueError(f"token ids must lie in [0, {vocab})")

    def decode(self, slots: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """One token per slot, committed; returns the logits ``[R, V]``."""
        return self.decode_output(slots, tokens).logits

    def decode_output(self, slots: list[int], tokens: torch.Tensor) -> ForwardOutput:
        """:meth:`decode`, returning the whole forward output (logits and hidden states)."""
        slots = self.cache.check_slots(slots)
        self._check_tokens(tokens)
        forest = DenseForest.chain(len(slots), 1, self.device)
        slot_t = torch.tensor(slots, dtype=torch.int32, device=self.device)
        batch = self.make_batch(tokens.to(self.device), forest, slot_t)
        out = self.forward(batch)
        ones = torch.ones(len(slots), dtype=torch.int64, device=self.device)
        self.commit(batch, out, torch.zeros(len(slots), 1, dtype=torch.int64,
                                            device=self.device), ones, kv_in_place=True)
        self.cache.advance(slots, [1] * len(slots))
        return out
