"""One speculative round on the device, in static buffers per batch bucket, captured in graphs.

A round over a bucket of R rows (the running requests, then padding rows on the cache's dummy
slot) runs three fixed-shape phases, each a CUDA graph on the GPU:

    draft          the MTP head grows every row's tree (device-side EAGLE-2 growth); host
                   drafters (n-gram, a separate draft model) upload their trees instead
    verify         forest structure, then the target's forward over all R x T node slots
    accept+commit  lossless acceptance, the commit (KV rows, GDN state, conv state, lengths),
                   the MTP head's rows of the accepted path, the next roots

and then one non-blocking copy of the emitted tokens into pinned memory, followed by the
round's single synchronisation. Between rounds the host touches the static buffers only when the
batch changes (a request joined or left): then it rewrites the per-row inputs in one upload.

Admission of short prompts (:meth:`RoundRunner.prefill`) is captured too, per batch bucket and
row width: the target's batched prefill and commit and the MTP head's pool rows in one graph,
so that a request joining a running batch costs a replay rather than an eager forward.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field, fields

import torch

from bole.engine.graphs import GraphRunner
from bole.speculative.budget.goodput import FIT_EVERY
from bole.speculative.budget.registry import make_policy
from bole.speculative.budget.round_select import select
from bole.engine.runner import (PREFILL_BATCH_MAX, PREFILL_BATCH_ROWS, ModelRunner,
                                prefill_bucket)
from bole.forest import DenseForest
from bole.speculative.accept_device import SamplingBatch, accept, draw_uniforms
from bole.speculative.budget.acceptance import learnt_acceptance
from bole.speculative.drafters.base import DrafterSetup
from bole.speculative.drafters.host_growth import build_draft_trees
from bole.speculative.drafters.registry import build_drafter
from bole.speculative.penalties import PenaltyCounts, penalize_forest
from bole.speculative.sampling import MAX_LOGPROBS, SamplingParams
from bole.speculative.tree_growth import TreeGrowth

log = logging.getLogger("bole.round")

#: batch buckets: a round pads its rows to the next one
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def buckets_upto(max_slots: int) -> list[int]:
    """The row counts rounds of an engine of ``max_slots`` slots pad to, ascending: the
    buckets below it, then ``max_slots`` itself (51 slots pay for 51 rows, not 64)."""
    return [b for b in BUCKETS if b < max_slots] + [max_slots]


def bucket_for(n: int, max_slots: int) -> int | None:
    """The rows a round of ``n`` requests pads to (the smallest of :func:`buckets_upto` >= n),
    or None when n exceeds ``max_slots``."""
    return next((b for b in buckets_upto(max_slots) if b >= n), None)


def _wants_logprobs(requests) -> bool:
    return any(r.params.logprobs is not None for r in requests)


def _round_keys(R: int, W: int, kind: str, flags: tuple, learn: bool) -> tuple[tuple, tuple]:
    """The graph keys of a round's verify forward and of its acceptance and commit."""
    return ("verify", R, W, kind), ("accept", R, W, kind, flags, learn)


@dataclass
class RoundTimings:
    """Per-phase time summed over rounds (ms): device time between events on a GPU, wall time
    on the CPU; ``host`` is the rest of a round's wall time (the GPU idles meanwhile)."""

    rounds: int = 0
    draft: float = 0.0
    verify: float = 0.0
    accept_commit: float = 0.0
    host: float = 0.0
    total: float = 0.0
    syncs: int = 0
    #: the goodput policy's plain rounds (no drafting)
    plain_rounds: int = 0
    #: draft nodes verified by the batch, over the drafting rounds of a shared budget
    draft_nodes: int = 0
    budget_rounds: int = 0
    #: per batch size (requests in the round): [rounds, tokens emitted, ms]
    by_batch: dict = field(default_factory=dict)
    #: shared budgets: rounds per count of verified draft nodes (kind "select" or "whole")
    by_nodes: dict = field(default_factory=dict)
    #: drafting rounds of the device drafters per draft depth
    by_depth: dict = field(default_factory=dict)

    def add(self, t: dict) -> None:
        self.rounds += 1
        for k in ("draft", "verify", "accept_commit", "host", "total", "syncs"):
            setattr(self, k, getattr(self, k) + t[k])
        self.plain_rounds += int(t.get("plain", 0))
        if t.get("draft_nodes") is not None:
            self.draft_nodes += t["draft_nodes"]
            key = (t.get("kind", "select"), t["draft_nodes"])
            self.by_nodes[key] = self.by_nodes.get(key, 0) + 1
            self.budget_rounds += 1
        if t.get("depth") is not None:
            self.by_depth[t["depth"]] = self.by_depth.get(t["depth"], 0) + 1
        if "requests" in t:
            row = self.by_batch.setdefault(t["requests"], [0, 0, 0.0])
            row[0] += 1
            row[1] += t["tokens"]
            row[2] += t["total"]

    def full_batch_rate(self) -> tuple[float, int] | None:
        """``(tokens/s, rounds)`` over the rounds that ran the most requests: what the batch
        decodes while every slot is busy (a static batch's last rounds run only the
        requests that are not done yet, a batch kept full never does). None before a round."""
        if not self.by_batch:
            return None
        rounds, tokens, ms = self.by_batch[max(self.by_batch)]
        return tokens / max(ms / 1e3, 1e-9), rounds

    def decode_split(self, decoded_tokens: int, elapsed_s: float) -> tuple[float, float]:
        """``(decoded_tokens`` over the rounds' time in tokens/s, the seconds of a run of
        ``elapsed_s`` spent outside rounds: admissions and prefills)."""
        round_s = self.total / 1e3
        return decoded_tokens / max(round_s, 1e-9), max(0.0, elapsed_s - round_s)

    def summary(self) -> dict:
        n = max(1, self.rounds)
        return dict(round_ms=self.total / n, draft_ms=self.draft / n, verify_ms=self.verify / n,
                    accept_commit_ms=self.accept_commit / n, host_ms=self.host / n,
                    syncs_per_round=self.syncs / n,
                    gpu_idle_share=self.host / max(self.total, 1e-9),
                    plain_round_share=self.plain_rounds / n,
                    draft_nodes_per_round=(self.draft_nodes / self.budget_rounds
                                           if self.budget_rounds else None))


class StaticSampling:
    """Per-row sampling parameters in static device tensors, and the host flags that choose the
    acceptance variant (a graph per variant): padding rows are greedy."""

    GREEDY = SamplingParams(temperature=0)

    def __init__(self, R: int, device):
        self.R = R
        template = SamplingBatch.from_params([self.GREEDY] * R, device)
        self.tensors = {f.name: getattr(template, f.name) for f in fields(template)
                        if isinstance(getattr(template, f.name), torch.Tensor)}
        self.flags = self.flags_for([])

    @staticmethod
    def flags_for(params, logprobs: bool = False) -> tuple:
        """The acceptance variant of a batch: one for every mix of greedy and sampled rows;
        top-k widths by powers of two; whether any row is penalised; whether any row returns
        logprobs (``logprobs``). A batch without penalties or logprobs does no work for them."""
        sampled = [p for p in params if not p.greedy]
        k = max([p.top_k for p in sampled], default=0)
        return (not sampled, True, any(p.top_k > 0 for p in sampled),
                any(p.top_p < 1 for p in sampled), 1 << (k - 1).bit_length() if k else 0,
                any(p.penalized for p in params), bool(logprobs))

    def write(self, params, logprobs: bool = False) -> None:
        host = SamplingBatch.from_params(list(params) + [self.GREEDY] * (self.R - len(params)))
        for name, dev in self.tensors.items():
            src = getattr(host, name)
            dev.copy_(src.pin_memory() if dev.is_cuda else src, non_blocking=True)
        self.flags = self.flags_for(params, logprobs)

    @property
    def all_greedy(self) -> bool:
        return self.flags[0]

    @property
    def logprobs(self) -> bool:
        return self.flags[6]

    def batch(self) -> SamplingBatch:
        all_greedy, any_greedy, any_top_k, any_top_p, max_top_k, penalized = self.flags[:6]
        return SamplingBatch(**self.tensors, all_greedy=all_greedy, any_greedy=any_greedy,
                             any_top_k=any_top_k, any_top_p=any_top_p, max_top_k=max_top_k,
                             any_penalty=penalized)


class RoundBuffers:
    """Static inputs and outputs of a round for a bucket of R rows x T node slots."""

    def __init__(self, R: int, T: int, D: int, K: int, device, dummy_slot: int):
        i64, dev = torch.int64, device
        self.R, self.T = R, T
        self.slots = torch.full((R,), dummy_slot, dtype=torch.int32, device=dev)
        self.active = torch.zeros(R, dtype=torch.bool, device=dev)
        self.roots = torch.zeros(R, dtype=i64, device=dev)
        self.remaining = torch.zeros(R, dtype=i64, device=dev)
        self.sampling = StaticSampling(R, dev)
        self.uniforms = torch.zeros(R, D + 1, K + 1, device=dev)
        self.tree_tokens = torch.zeros(R, T, dtype=i64, device=dev)
        self.tree_parents = torch.full((R, T), -1, dtype=i64, device=dev)
        self.tree_valid = torch.zeros(R, T, dtype=torch.bool, device=dev)
        self.tree_valid[:, 0] = True
        self.tree_rho = torch.zeros(R, T, dtype=torch.float64, device=dev)
        self.tree_rho[:, 0] = 1.0
        self.budget = torch.zeros((), dtype=i64, device=dev)   # draft nodes of the batch
        self.kept = torch.zeros(R, dtype=i64, device=dev)      # per row, before compaction
        self.emitted = torch.zeros(R, D + 1, dtype=i64, device=dev)
        self.num_emitted = torch.zeros(R, dtype=i64, device=dev)
        pin = dev.type == "cuda"
        self.emitted_host = torch.zeros(R, D + 1, dtype=i64, pin_memory=pin)
        self.num_host = torch.zeros(R, dtype=i64, pin_memory=pin)
        self.kept_host = torch.zeros(R, dtype=i64, pin_memory=pin)
        # goodput: whether the last choice could still change (Selected.widen)
        self.widen = torch.ones((), dtype=torch.bool, device=dev)
        self.widen_host = torch.ones((), dtype=torch.bool, pin_memory=pin)
        self.goodput = None                         # the goodput policy's inputs (round_select.py)
        self.rows: tuple = ()                      # (request index, slot) of the rows last written
        self.logprobs: RoundLogprobs | None = None  # made by the first round that returns them


@dataclass
class RoundLogprobs:
    """A round's log-probabilities at each emitted token (device, then pinned host copies):
    ``token [R, D + 1]`` the emitted token's, ``top_ids``/``top [R, D + 1, L]`` the L =
    min(:data:`MAX_LOGPROBS`, V) most likely tokens' (descending)."""

    token: torch.Tensor
    top_ids: torch.Tensor
    top: torch.Tensor
    host: tuple

    @classmethod
    def empty(cls, R: int, D: int, vocab: int, device) -> "RoundLogprobs":
        L = min(MAX_LOGPROBS, vocab)
        dev = (torch.zeros(R, D + 1, device=device),
               torch.zeros(R, D + 1, L, dtype=torch.int64, device=device),
               torch.zeros(R, D + 1, L, device=device))
        pin = torch.device(device).type == "cuda"
        return cls(*dev, tuple(torch.zeros(t.shape, dtype=t.dtype, pin_memory=pin) for t in dev))

    def write(self, logits: torch.Tensor, path: torch.Tensor, emitted: torch.Tensor) -> None:
        """From the raw ``logits [R, W, V]`` at the accepted ``path [R, D + 1]`` (node j's
        logits gave emitted token j): log_softmax in fp32, the emitted tokens' entries and the
        top L."""
        R, W, V = logits.shape
        rows = torch.gather(logits, 1, path[:, :, None].expand(R, path.shape[1], V))
        lp = torch.log_softmax(rows.float(), dim=-1)
        self.token.copy_(torch.gather(lp, 2, emitted.clamp(min=0)[:, :, None])[:, :, 0])
        top = torch.topk(lp, self.top.shape[-1], dim=-1)
        self.top.copy_(top.values)
        self.top_ids.copy_(top.indices)

    def to_host(self) -> None:
        for host, dev in zip(self.host, (self.token, self.top_ids, self.top)):
            host.copy_(dev, non_blocking=True)

    def rows(self, counts: list[int], wanted: list[int | None]) -> list[list | None]:
        """Host reading after the round's synchronisation: per request (``wanted``: its top
        count, None for none), one ``(logprob, [(token, logprob), ...])`` per emitted token."""
        token, ids, top = (t.tolist() for t in self.host)
        return [None if k is None else
                [(token[i][j], list(zip(ids[i][j][:k], top[i][j][:k]))) for j in range(n)]
                for i, (n, k) in enumerate(zip(counts, wanted))]


class PrefillBuffers:
    """Static inputs of a batched admission prefill: R rows of T tokens, then each row's length
    and slot, in one ``[R, T + 2]`` int64 buffer (padding rows: the cache's dummy slot, length
    0), filled by one upload from pinned memory."""

    def __init__(self, R: int, T: int, device, dummy_slot: int):
        self.R, self.T, self.dummy_slot = R, T, dummy_slot
        self.packed = torch.zeros(R, T + 2, dtype=torch.int64, device=device)
        self.packed[:, T + 1] = dummy_slot
        self.host = torch.zeros(R, T + 2, dtype=torch.int64,
                                pin_memory=torch.device(device).type == "cuda")
        self.tokens, self.lengths = self.packed[:, :T], self.packed[:, T]

    @property
    def slots(self) -> torch.Tensor:
        """``[R]`` int32 (a conversion on the device: inside the captured forward)."""
        return self.packed[:, self.T + 1].to(torch.int32)

    def write(self, slots: list[int], tokens: torch.Tensor, lengths: list[int]) -> None:
        """The rows of one admission (``tokens [n, T]`` on the host) in one upload. The previous
        upload from the pinned buffer is done: its admission read its first tokens."""
        n = len(slots)
        self.host.zero_()
        self.host[:n, :self.T] = tokens
        self.host[:n, self.T] = torch.tensor(lengths)
        self.host[:, self.T + 1] = self.dummy_slot
        self.host[:n, self.T + 1] = torch.tensor(slots)
        self.packed.copy_(self.host, non_blocking=True)


class RoundRunner:
    """Runs rounds of one mode over a model runner: buffers, drafters, graphs."""

    def __init__(self, runner: ModelRunner, spec, *, max_slots: int, draft_model=None,
                 cuda_graphs: bool = True, progress: bool = False, budget_profile=None):
        self.runner, self.spec = runner, spec
        self.max_slots = max_slots
        self.model, self.cache = runner.model, runner.cache
        self.device = self.model.device
        self.ar = spec.mode == "ar"
        self.T = spec.nodes_per_request
        self.D = 0 if self.ar else spec.depth
        self.topk = 1 if spec.mode == "chain" else spec.topk
        self.K = 1 if self.ar else self.topk
        self.policy = make_policy(spec, self.T, budget_profile) if not self.ar else \
            make_policy(type(spec)(mode="ar"), 1)
        #: the goodput policy's acceptance estimates, learnt from the rounds of every runner of
        #: this model and drafter in the process
        self.calibrator = learnt_acceptance(
            self.model, (spec.drafter, spec.acceptance, spec.draft_vocab,
                         spec.forced_acceptance), self.device) \
            if self.policy.chooses_width else None
        self._rounds_since_fit = 0
        #: the round's one drafter, chosen once (None in plain decoding); the device drafter
        #: grows trees in the draft graph, a host drafter's trees are uploaded
        self.drafter = None if self.ar else build_drafter(spec.drafter, DrafterSetup(
            self.model, max_slots, self.cache.max_len, self.D, self.topk, self.scratch,
            spec.acceptance, spec.draft_vocab, draft_model, ModelRunner))
        self.device_drafter = self.drafter if self.drafter and self.drafter.on_device else None
        self.buffers: dict[int, RoundBuffers] = {}
        #: per-slot output counts and prompt tokens of penalised requests (start_penalties)
        self.penalties: PenaltyCounts | None = None
        self.last_logprobs: list = []
        self.prefill_buffers: dict[tuple[int, int], PrefillBuffers] = {}
        self.growth: dict[tuple[int, int], TreeGrowth] = {}      # (R, draft depth)
        #: the next round's draft, queued at the end of the last one (see :meth:`run`): its
        #: buffers, the marks around it, and the host clock (s) when the GPU started it and
        #: when that call returned
        self._pending: RoundBuffers | None = None
        self._pending_depth = self.D                # the depth it grew
        self._queued: tuple = ()
        self.runner.reserve_snapshots(max_slots * self.T)   # tree-serial, chain: one store
        self.graphs = GraphRunner(self.device, cuda_graphs and self.model.graph_safe)
        if cuda_graphs and not self.model.graph_safe and self.device.type == "cuda":
            log.warning("MoE routing syncs the host: rounds of this model run eagerly")
        if self.graphs.enabled:
            self.capture_all(max_slots, progress)

    @property
    def scratch(self) -> int:
        """Rows past a request's committed tokens that a round writes (its tree, its path)."""
        return max(self.T, self.D + 1)

    # ---- buffers and graphs ----
    def _buffers(self, R: int) -> RoundBuffers:
        if R not in self.buffers:
            self.buffers[R] = RoundBuffers(R, self.T, self.D, self.K, self.device,
                                           self.cache.dummy_slot)
            self.buffers[R].goodput = self.policy.goodput_inputs(R, self.device)
        return self.buffers[R]

    def capture_all(self, max_slots: int, progress: bool) -> None:
        """Capture every bucket's greedy round up to ``max_slots`` rows, largest first, at
        every verify width the budget policy can pick (a capture inside a timed round costs
        hundreds of milliseconds)."""
        buckets = buckets_upto(max_slots)
        t0 = time.perf_counter()
        for i, R in enumerate(sorted(set(buckets), reverse=True)):
            if progress:
                print(f"\r[bole] capturing CUDA graphs: batch {R} ({i + 1}/{len(buckets)})",
                      end="", file=sys.stderr, flush=True)
            for kind, W, learn in self.policy.variants(R):
                self._capture(R, StaticSampling.flags_for([]), kind, W, learn)
            if self.calibrator is not None and not self.graphs.has(("fit",)):
                self.graphs.capture(("fit",), self.calibrator.fit)
            for T in self.prefill_widths() if R <= PREFILL_BATCH_ROWS else ():
                self.graphs.capture(("prefill", R, T), lambda: self._prefill(R, T))
        if progress:
            print(f"\r[bole] captured {len(self.graphs.graphs)} CUDA graphs for batches up to "
                  f"{max(buckets)} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    def _capture(self, R: int, flags: tuple, kind: str, W: int, learn: bool) -> None:
        """Capture bucket R's phases for a round of ``kind`` at verify width W, the acceptance
        for sampling variant ``flags`` (counting into the acceptance estimates when ``learn``).
        The warm-up runs execute, so every row first points at the dummy slot."""
        b = self._buffers(R)
        b.rows = ()
        self._pending = None
        b.slots.fill_(self.cache.dummy_slot)
        b.active.zero_()
        b.roots.zero_()
        b.remaining.zero_()
        b.sampling.flags = flags
        b.budget.fill_(self.policy.budget(R))
        for depth in self.policy.draft_depths() if self.device_drafter is not None else ():
            if not self.graphs.has(("draft", R, depth)):
                self.graphs.capture(("draft", R, depth), lambda d=depth: self._draft(b, d))
        vkey, akey = _round_keys(R, W, kind, b.sampling.flags, learn)
        if not self.graphs.has(vkey):
            self.graphs.capture(vkey, lambda: self._verify(b, W, kind))
        # a capture runs nothing: replay the forward once so that its outputs hold real values
        # (of the dummy rows) before the acceptance's warm-up reads them
        self.graphs.graphs[vkey].replay()
        verified = self.graphs.results[vkey]
        self.graphs.capture(akey, lambda: self._accept_commit(b, learn, *verified))

    # ---- admission ----
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

    # ---- the phases (device code only) ----
    def _draft(self, b: RoundBuffers, depth: int) -> None:
        """Grow every row's tree ``depth`` levels (a row within ``depth`` tokens of its limit:
        fewer) into the round's buffers."""
        ctx = self.cache.lengths[b.slots.long()]
        limit = torch.where(b.active, (b.remaining - 1).clamp(0, depth), 0)
        step = self.device_drafter.step_fn(b.slots, ctx, self.topk)
        key = (b.R, depth)
        if key not in self.growth:
            self.growth[key] = TreeGrowth(b.R, self.topk, depth, self.T, self.device)
        trees = self.growth[key].grow(b.roots, limit, step)
        b.tree_tokens.copy_(trees.tokens)
        b.tree_parents.copy_(trees.parents)
        b.tree_valid.copy_(trees.valid)
        b.tree_rho.copy_(trees.rho)

    def _verify(self, b: RoundBuffers, W: int, kind: str):
        """The forest of a round of ``kind`` (a select round's batch-shared selection compacted
        to width W, a whole round's every drafted node, a plain round's roots) and the target's
        forward over it; returns (batch, output, tokens, the verified nodes' rho ``[R, W]`` or
        None for plain rounds)."""
        tokens, rho = b.tree_tokens, b.tree_rho
        gdn = None
        if self.ar or kind == "plain":            # plain decoding (ar, goodput's plain rounds)
            tokens, rho = b.tree_tokens[:, :1], None
            tokens.copy_(b.roots[:, None])
            forest = DenseForest.chain(b.R, 1, self.device)
            gdn = self.runner.gdn.split("-")[0] + "-decode"    # each state updated in place
        elif kind == "select":
            sel = select(b.tree_rho, b.tree_tokens, b.tree_parents, b.tree_valid, b.budget,
                         b.active, self.spec.root_floor, W, self.D, goodput=b.goodput,
                         acceptance=self.calibrator, row_width=self.policy.row_width(b.R))
            b.kept.copy_(sel.kept)
            if sel.widen is not None:
                b.widen.copy_(sel.widen)
            tokens, forest, rho = sel.tokens, sel.forest, sel.rho
        else:
            forest = DenseForest.from_parents(b.tree_parents, b.tree_valid, self.D)
            if self.policy.shared:
                b.kept.copy_(b.tree_valid.sum(1))
        batch = self.runner.make_batch(tokens.reshape(-1), forest, b.slots, gdn)
        return batch, self.runner.forward(batch), tokens, rho

    def _accept_commit(self, b: RoundBuffers, learn: bool, batch, out, tokens,
                       rho=None) -> None:
        R, W = tokens.shape
        raw = logits = out.logits.view(R, W, -1)
        forced = None
        if self.spec.forced_acceptance and self.device_drafter is not None:
            forced = self.device_drafter.forced_targets(b.slots, batch.ctx_lens, batch.forest.depth)
        sampling = b.sampling.batch()
        if sampling.any_penalty:
            slots = b.slots.long()
            logits = penalize_forest(logits, tokens, batch.forest, self.penalties.counts[slots],
                                     self.penalties.prompt[slots], sampling.presence,
                                     sampling.frequency, sampling.repetition)
        acc = accept(logits, tokens, batch.forest, sampling, b.uniforms,
                     max_children=self.K, forced=forced)
        path_len = torch.where(b.active, acc.path_len, 0)
        if sampling.any_penalty:
            self.penalties.add(b.slots, acc.emitted, path_len)
        if b.sampling.logprobs:
            b.logprobs.write(raw, acc.path, acc.emitted)
        if learn and self.calibrator is not None and rho is not None:
            # every verified draft node of an active row: was it on the accepted path?
            on_path = torch.zeros_like(tokens, dtype=torch.bool).scatter_(1, acc.path, True)
            drafted = batch.forest.valid & (batch.forest.parents >= 0) & b.active[:, None]
            self.calibrator.observe(rho, on_path, drafted)
        ctx = batch.ctx_lens
        # a lone root's KV row is its final row; in-place GDN decoding leaves no factors
        path_global = self.runner.commit(batch, out, acc.path, path_len, kv_in_place=W == 1)
        if self.device_drafter is not None:
            self.device_drafter.observe_accepted(b.slots, tokens, acc.path, path_global, out.hidden, ctx,
                                      path_len)
        b.emitted.copy_(acc.emitted)
        b.num_emitted.copy_(path_len)
        b.roots.copy_(acc.bonus)
        b.remaining.sub_(path_len)

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

    def _write_rows(self, b: RoundBuffers, requests) -> bool:
        """Per-row inputs after the batch changed: one upload of slots, roots, budgets, params.
        Returns whether anything was written."""
        rows = tuple((r.index, r.slot) for r in requests)
        if rows == b.rows:
            return False
        n, dummy = len(requests), self.cache.dummy_slot
        slots = [r.slot for r in requests] + [dummy] * (b.R - n)
        host = torch.tensor([slots, [1] * n + [0] * (b.R - n),
                             [r.out[-1] for r in requests] + [0] * (b.R - n),
                             [r.remaining for r in requests] + [0] * (b.R - n)], dtype=torch.int64)
        if self.device.type == "cuda":
            host = host.pin_memory()
        dev = host.to(self.device, non_blocking=True)
        b.slots.copy_(dev[0])
        b.active.copy_(dev[1].bool())
        b.roots.copy_(dev[2])
        b.remaining.copy_(dev[3])
        b.sampling.write([r.params.sampling for r in requests], _wants_logprobs(requests))
        b.budget.fill_(self.policy.budget(n))
        b.rows = rows
        return True

    def _host_trees(self, b: RoundBuffers, requests) -> None:
        """Trees from a host drafter (n-gram lookup, a separate draft model), uploaded."""
        roots = [r.out[-1] for r in requests]
        depths = [max(0, min(self.D, r.remaining - 1)) for r in requests]
        expand = self.drafter.tree_expander([r.slot for r in requests],
                                            [r.prompt + r.out for r in requests])
        results = build_draft_trees(roots, expand, depths=depths, topk=self.topk, budget=self.T)
        tokens = torch.zeros(b.R, self.T, dtype=torch.int64)
        parents = torch.full((b.R, self.T), -1, dtype=torch.int64)
        valid = torch.zeros(b.R, self.T, dtype=torch.bool)
        valid[:, 0] = True
        rho = torch.zeros(b.R, self.T, dtype=torch.float64)
        rho[:, 0] = 1.0
        for i, res in enumerate(results):
            n = res.tree.num_nodes
            tokens[i, :n], parents[i, :n], valid[i, :n] = res.tokens, res.tree.parents, True
            rho[i, :n] = res.rho
        for host, dev in ((tokens, b.tree_tokens), (parents, b.tree_parents), (valid, b.tree_valid),
                          (rho, b.tree_rho)):
            dev.copy_(host.pin_memory() if self.device.type == "cuda" else host, non_blocking=True)

    def _draw_uniforms(self, b: RoundBuffers, requests) -> None:
        """Each sampled row's acceptance draws from its request's own generator (padding and
        greedy rows keep zeros): a request's samples do not depend on the batch around it."""
        rows = [draw_uniforms(1, self.D, self.K, r.gen, self.device)[0]
                if not r.params.sampling.greedy else torch.zeros_like(b.uniforms[0])
                for r in requests]
        rows += [torch.zeros_like(b.uniforms[0])] * (b.R - len(requests))
        b.uniforms.copy_(torch.stack(rows))

    def run(self, requests, prelaunch: bool = False) -> tuple[list[list[int]], dict]:
        """One round over the running ``requests``: each one's new tokens, and the timings.

        ``prelaunch``: the caller expects the same requests in the next round (nobody waits to
        be admitted). Then, where no request can finish by length in this round, the next
        round's draft is queued on the device right after this round's acceptance, before the
        round's synchronisation: it runs while the host reads the tokens, and the next call
        skips its draft. Everything it reads (roots, lengths, remaining tokens) is already on
        the device; if the batch changes after all (a stop token, a cancellation), the next
        call rewrites the rows and drafts again, in stream order after the stale draft."""
        t_start = time.perf_counter()
        R = bucket_for(len(requests), self.max_slots)
        if R is None:
            raise ValueError(f"{len(requests)} requests exceed the engine's {self.max_slots} "
                             "slots")
        b = self._buffers(R)
        flags = StaticSampling.flags_for([r.params.sampling for r in requests],
                                         _wants_logprobs(requests))
        if flags[6] and b.logprobs is None:
            b.logprobs = RoundLogprobs.empty(R, self.D, self.model.config.vocab_size,
                                             self.device)
        kind = self.policy.plan(R)
        plain = kind == "plain"
        depth = self.policy.round_depth(R)
        W = self.policy.width(R, len(requests), kind)
        learn = self.policy.learns(kind, R)
        vkey, akey = _round_keys(R, W, kind, flags, learn)
        captures = self.graphs.enabled and not self.graphs.has(akey)
        if captures:
            log.info("capturing the %s round for batch %d, width %d, sampling variant %s", kind,
                     R, W, flags)
            self._capture(R, flags, kind, W, learn)
        rewrote = self._write_rows(b, requests)
        queued = self._queued
        drafted = self._pending is b and not rewrote and \
            self.policy.takes_draft(R, self._pending_depth)
        if drafted:
            depth = self._pending_depth
        if not plain:
            self.policy.drafts(R, kind, depth)
        self._pending, self._queued = None, ()
        if not b.sampling.all_greedy:
            self._draw_uniforms(b, requests)
        cuda = self.device.type == "cuda"
        marks = []

        def mark(into: list):
            if cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                into.append(ev)
            else:
                into.append(time.perf_counter())
        if b.goodput is not None and kind == "select":
            b.goodput.overhead_ms.fill_(self.policy.round_overhead_ms(R))
        mark(marks)
        if plain:
            pass                                   # goodput decided drafting does not pay
        elif self.device_drafter is not None and not drafted:
            self.graphs.run(("draft", R, depth), lambda: self._draft(b, depth))
        elif self.device_drafter is None and not self.ar:
            self._host_trees(b, requests)
        mark(marks)
        verified = self.graphs.run(vkey, lambda: self._verify(b, W, kind))
        mark(marks)
        self.graphs.run(akey, lambda: self._accept_commit(b, learn, *verified))
        if self.calibrator is not None and learn:
            self._rounds_since_fit += 1
            if self._rounds_since_fit >= FIT_EVERY:
                self.graphs.run(("fit",), self.calibrator.fit)
                self._rounds_since_fit = 0
        mark(marks)
        b.emitted_host.copy_(b.emitted, non_blocking=True)
        b.num_host.copy_(b.num_emitted, non_blocking=True)
        if self.policy.shared:
            b.kept_host.copy_(b.kept, non_blocking=True)
        if b.sampling.logprobs:
            b.logprobs.to_host()
        chose = self.policy.chooses_width and kind == "select"
        if chose:                        # only a choice says whether a wider width could pay
            b.widen_host.copy_(b.widen, non_blocking=True)
        if cuda:
            done = torch.cuda.Event()
            done.record()
        next_marks: list = []
        if prelaunch and self._may_prelaunch(requests, plain):
            next_depth = self.policy.next_depth(R)
            mark(next_marks)
            self.graphs.run(("draft", R, next_depth), lambda: self._draft(b, next_depth))
            mark(next_marks)
            self._pending, self._pending_depth = b, next_depth
        if cuda:
            done.synchronize()                   # the round's one synchronisation
            elapsed = lambda a, z: a.elapsed_time(z)  # noqa: E731
        else:
            elapsed = lambda a, z: 1e3 * (z - a)  # noqa: E731
        ms = [elapsed(marks[i], marks[i + 1]) for i in range(3)]
        # a draft queued by the last call ran (partly) between the two calls: its device time is
        # this round's draft (added to a fresh one when the rows changed under it), and the
        # part that fell between the calls joins this round's wall time
        carry = hidden = 0.0
        if queued:
            q_marks, q_start, q_return = queued
            q_ms = elapsed(*q_marks)
            ms[0] = q_ms if drafted else ms[0] + q_ms
            # on the CPU it ran inside the last call (whose time left it out): all of it
            carry = max(0.0, min(q_start + q_ms / 1e3, t_start) - q_return) if cuda else \
                q_ms / 1e3
            # what ran while the last call still read its tokens is in no round's wall time
            if drafted and cuda:
                hidden = min(q_ms, 1e3 * max(0.0, q_return - q_start))
        t_sync = time.perf_counter()
        own_draft = elapsed(*next_marks) / 1e3 if next_marks and not cuda else 0.0
        counts = b.num_host[:len(requests)].tolist()
        draft_nodes = None
        if self.policy.shared and not plain:
            kept = b.kept_host[:len(requests)].tolist()
            widen = bool(b.widen_host) if chose else None
            # the next width follows the rows that drafted whole trees: one near its token limit
            # drafts a shallower tree, whose count says nothing of the next request's
            grown = [k for k, r in zip(kept, requests) if r.remaining > self.D]
            self.policy.observe(R, grown, kind, widen)
            draft_nodes = sum(min(k, W) - 1 for k in kept)      # verified, past the roots
        emitted = b.emitted_host[:len(requests)].tolist()
        new = [row[:n] for row, n in zip(emitted, counts)]
        #: per request, the emitted tokens' logprobs (None where not asked for)
        self.last_logprobs = b.logprobs.rows(counts, [r.params.logprobs for r in requests]) \
            if b.sampling.logprobs else [None] * len(requests)
        self.cache.advance([r.slot for r in requests], counts)
        if self.drafter is not None and not self.drafter.on_device:
            for r, toks in zip(requests, new):
                self.drafter.observe(r.slot, [r.out[-1]] + toks[:-1])
        t_return = time.perf_counter()
        if next_marks:        # the GPU starts the queued draft at the sync
            self._queued = (tuple(next_marks), t_sync, t_return)
        # the CPU ran the queued draft inside this call: it counts in the next round's time
        total = 1e3 * (t_return - t_start - own_draft + carry)
        host = max(0.0, total - sum(ms))
        if b.goodput is not None:
            # what this round delivered per request per ms, over the requests whose whole tree
            # could be accepted (one near its token limit drafts a shallower tree: its tokens
            # say nothing of what drafting delivers, while a plain round's say everything)
            full = [c for c, r in zip(counts, requests) if plain or r.remaining > self.D]
            measured = bool(full) and not captures and not (queued and (plain or not drafted))
            self.policy.after_round(R, plain, ms[0], ms[2],
                                    sum(full) / (max(len(full), 1) * max(total, 1e-6)),
                                    host_ms=host, measured=measured)
            if kind == "whole":
                self.policy.after_whole(R, depth, [c - 1 for c in full], ms[0],
                                        total - (ms[0] - hidden), measured, hidden)
        timing = dict(draft=ms[0], verify=ms[1], accept_commit=ms[2],
                      host=host, total=total, syncs=1, plain=plain,
                      draft_nodes=draft_nodes, kind=kind, requests=len(requests),
                      tokens=sum(counts), depth=None if plain or self.device_drafter is None else depth)
        return new, timing

    def start_penalties(self, slot: int, prompt: list[int], first: int) -> None:
        """A penalised request admitted into ``slot`` emitted its ``first`` token: its counts
        start (the per-slot count tensors are made by the first such request)."""
        if self.penalties is None:
            self.penalties = PenaltyCounts(self.cache.max_slots + 1,
                                           self.model.config.vocab_size, self.device)
        self.penalties.start(slot, prompt, first)

    def _may_prelaunch(self, requests, plain: bool) -> bool:
        """Whether the next round's draft can be queued now: the device drafter grows it, this
        round drafted and is not goodput's look (after a look the next round is as likely
        plain; after other rounds it may still be, if this one decides so: the queued draft is
        then dropped, its time counted in the plain round, which goodput does not average),
        and no request can reach its token limit in this round."""
        return (self.device_drafter is not None and not plain and not self.policy.looking
                and all(r.remaining > self.D + 1 for r in requests))
