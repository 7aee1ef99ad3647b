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
so that a request joining a running batch costs a replay rather than an eager forward."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

import torch

from bole.engine.admission import RoundAdmission
from bole.engine.buckets import bucket_for, buckets_upto
from bole.engine.buffers import PrefillBuffers, RoundBuffers, RoundLogprobs, StaticSampling
from bole.engine.graphs import GraphRunner
from bole.engine.phases import RoundPhases
from bole.engine.runner import PREFILL_BATCH_ROWS, ModelRunner
from bole.speculative.accept_device import draw_uniforms
from bole.speculative.budget.acceptance import learnt_acceptance
from bole.speculative.budget.goodput import FIT_EVERY
from bole.speculative.budget.registry import make_policy
from bole.speculative.drafters.base import DrafterSetup
from bole.speculative.drafters.host_growth import build_draft_trees
from bole.speculative.drafters.registry import build_drafter
from bole.speculative.penalties import PenaltyCounts
from bole.speculative.tree_growth import TreeGrowth

__all__ = ["RoundPlan", "RoundResult", "RoundRunner"]

log = logging.getLogger("bole.round")

def _wants_logprobs(requests) -> bool:
    return any(r.params.logprobs is not None for r in requests)


def _round_keys(R: int, W: int, kind: str, flags: tuple, learn: bool) -> tuple[tuple, tuple]:
    """The graph keys of a round's verify forward and of its acceptance and commit."""
    return ("verify", R, W, kind), ("accept", R, W, kind, flags, learn)


@dataclass
class RoundPlan:
    """One round as the budget policy planned it (:meth:`RoundRunner.plan`).

    requests:  the running requests, one row each; R their batch bucket (rows, padding after).
    kind:      "plain", "select" or "whole" (:mod:`bole.speculative.budget.policy`).
    depth:     the draft depth; width: the verify width (node slots per row).
    learn:     whether the round counts its nodes into the acceptance estimates.
    flags:     the sampling variant (:meth:`StaticSampling.flags_for`); chose: whether the device
               chooses the verify width (goodput's select rounds).
    prelaunch: whether the next round's draft may be queued before the synchronisation.
    t_start:   the host clock when planning began (s).
    """

    requests: list
    R: int
    kind: str
    depth: int
    width: int
    learn: bool
    flags: tuple
    chose: bool
    prelaunch: bool
    t_start: float

    @property
    def plain(self) -> bool:
        return self.kind == "plain"

    @property
    def keys(self) -> tuple[tuple, tuple]:
        """The graph keys of the round's verify forward and of its acceptance and commit."""
        return _round_keys(self.R, self.width, self.kind, self.flags, self.learn)


@dataclass
class RoundResult:
    """What a round delivered: each request's new tokens ``[n_r]``, their logprobs (None where
    not asked for) and the round's timings (:class:`~bole.engine.timings.RoundTimings.add`)."""

    tokens: list[list[int]]
    logprobs: list
    timing: dict


class RoundRunner(RoundPhases, RoundAdmission):
    """Runs rounds of one mode over a model runner: buffers, drafters, graphs."""

    def __init__(self, runner: ModelRunner, spec, *, max_slots: int, draft_model=None,
                 cuda_graphs: bool = True, progress: bool = False, budget_profile=None):
        self.runner, self.spec = runner, spec
        self.max_slots = max_slots
        self.model, self.cache = runner.model, runner.cache
        self.device = self.model.device
        self.cuda = self.device.type == "cuda"
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
        b.sampling.write([r.params for r in requests], _wants_logprobs(requests))
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
                if not r.params.greedy else torch.zeros_like(b.uniforms[0])
                for r in requests]
        rows += [torch.zeros_like(b.uniforms[0])] * (b.R - len(requests))
        b.uniforms.copy_(torch.stack(rows))

    # ---- one round: plan, launch, synchronise, read ----
    def plan(self, requests, prelaunch: bool = False) -> RoundPlan:
        """The budget policy's plan of one round over the running ``requests`` (the round's
        clock starts here: planning counts in its host time). ``prelaunch``: see :meth:`run`."""
        t_start = time.perf_counter()
        R = bucket_for(len(requests), self.max_slots)
        if R is None:
            raise ValueError(f"{len(requests)} requests exceed the engine's {self.max_slots} "
                             "slots")
        b = self._buffers(R)
        flags = StaticSampling.flags_for([r.params for r in requests],
                                         _wants_logprobs(requests))
        if flags[6] and b.logprobs is None:
            b.logprobs = RoundLogprobs.empty(R, self.D, self.model.config.vocab_size,
                                             self.device)
        kind = self.policy.plan(R)
        depth = self.policy.round_depth(R)
        W = self.policy.width(R, len(requests), kind)
        learn = self.policy.learns(kind, R)
        chose = self.policy.chooses_width and kind == "select"
        return RoundPlan(requests, R, kind, depth, W, learn, flags, chose, prelaunch, t_start)

    def run(self, plan: RoundPlan) -> RoundResult:
        """One round as ``plan`` says: each request's new tokens and logprobs, and the timings;
        the policy hears what the round kept and delivered before it returns.

        ``plan.prelaunch``: the caller expects the same requests in the next round (nobody waits
        to be admitted). Then, where no request can finish by length in this round, the next
        round's draft is queued on the device right after this round's acceptance, before the
        round's synchronisation: it runs while the host reads the tokens, and the next call
        skips its draft. Everything it reads (roots, lengths, remaining tokens) is already on
        the device; if the batch changes after all (a stop token, a cancellation), the next
        call rewrites the rows and drafts again, in stream order after the stale draft."""
        b = self._buffers(plan.R)
        captures = self._capture_missing(plan)
        queued, depth, drafted = self._start(plan, b)
        marks, done = self._launch(plan, b, depth, drafted)
        next_marks = self._queue_next_draft(plan, b)
        ms, carry, hidden = self._synchronise(done, marks, queued, drafted, plan.t_start)
        t_sync = time.perf_counter()
        own_draft = self._elapsed(*next_marks) / 1e3 if next_marks and not self.cuda else 0.0
        counts, draft_nodes = self._kept(plan, b)
        tokens, logprobs = self._emit(plan, b, counts)
        t_return = time.perf_counter()
        if next_marks:        # the GPU starts the queued draft at the sync
            self._queued = (tuple(next_marks), t_sync, t_return)
        # the CPU ran the queued draft inside this call: it counts in the next round's time
        total = 1e3 * (t_return - plan.t_start - own_draft + carry)
        timing = dict(draft=ms[0], verify=ms[1], accept_commit=ms[2],
                      host=max(0.0, total - sum(ms)), total=total, syncs=1, plain=plan.plain,
                      draft_nodes=draft_nodes, kind=plan.kind, requests=len(plan.requests),
                      tokens=sum(counts),
                      depth=None if plan.plain or self.device_drafter is None else depth)
        if b.goodput is not None:
            stale = bool(queued) and (plan.plain or not drafted)
            self._report(plan, counts, timing, hidden, depth, captures or stale)
        return RoundResult(tokens, logprobs, timing)

    def _elapsed(self, a, z) -> float:
        """ms between two marks: CUDA events on a GPU, host clock readings on the CPU."""
        return a.elapsed_time(z) if self.cuda else 1e3 * (z - a)

    def _mark(self, into: list) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            into.append(ev)
        else:
            into.append(time.perf_counter())

    def _capture_missing(self, plan: RoundPlan) -> bool:
        """Capture the plan's graphs if this variant has none yet (logged: it costs the round
        hundreds of milliseconds); whether it did."""
        captures = self.graphs.enabled and not self.graphs.has(plan.keys[1])
        if captures:
            log.info("capturing the %s round for batch %d, width %d, sampling variant %s",
                     plan.kind, plan.R, plan.width, plan.flags)
            self._capture(plan.R, plan.flags, plan.kind, plan.width, plan.learn)
        return captures

    def _start(self, plan: RoundPlan, b: RoundBuffers) -> tuple[tuple, int, bool]:
        """The rows' inputs, the queued draft taken or dropped, the uniforms: ``(the last
        call's queued draft's marks, the draft depth, whether the queued draft is used)``."""
        rewrote = self._write_rows(b, plan.requests)
        queued, depth = self._queued, plan.depth
        drafted = self._pending is b and not rewrote and \
            self.policy.takes_draft(plan.R, self._pending_depth)
        if drafted:
            depth = self._pending_depth
        if not plan.plain:
            self.policy.drafts(plan.R, plan.kind, depth)
        self._pending, self._queued = None, ()
        if not b.sampling.all_greedy:
            self._draw_uniforms(b, plan.requests)
        return queued, depth, drafted

    def _launch(self, plan: RoundPlan, b: RoundBuffers, depth: int, drafted: bool):
        """The round's phases (draft, verify, accept and commit) and the copies of what it
        emits into pinned memory; ``(the four phase marks, the event after the copies)``."""
        R, W, kind = plan.R, plan.width, plan.kind
        vkey, akey = plan.keys
        marks: list = []
        if b.goodput is not None and kind == "select":
            b.goodput.overhead_ms.fill_(self.policy.round_overhead_ms(R))
        self._mark(marks)
        if plan.plain:
            pass                                   # goodput decided drafting does not pay
        elif self.device_drafter is not None and not drafted:
            self.graphs.run(("draft", R, depth), lambda: self._draft(b, depth))
        elif self.device_drafter is None and not self.ar:
            self._host_trees(b, plan.requests)
        self._mark(marks)
        verified = self.graphs.run(vkey, lambda: self._verify(b, W, kind))
        self._mark(marks)
        self.graphs.run(akey, lambda: self._accept_commit(b, plan.learn, *verified))
        if self.calibrator is not None and plan.learn:
            self._rounds_since_fit += 1
            if self._rounds_since_fit >= FIT_EVERY:
                self.graphs.run(("fit",), self.calibrator.fit)
                self._rounds_since_fit = 0
        self._mark(marks)
        b.emitted_host.copy_(b.emitted, non_blocking=True)
        b.num_host.copy_(b.num_emitted, non_blocking=True)
        if self.policy.shared:
            b.kept_host.copy_(b.kept, non_blocking=True)
        if b.sampling.logprobs:
            b.logprobs.to_host()
        if plan.chose:                   # only a choice says whether a wider width could pay
            b.widen_host.copy_(b.widen, non_blocking=True)
        done = None
        if self.cuda:
            done = torch.cuda.Event()
            done.record()
        return marks, done

    def _queue_next_draft(self, plan: RoundPlan, b: RoundBuffers) -> list:
        """Queue the next round's draft before the synchronisation when it may (:meth:`run`);
        its marks, or none."""
        next_marks: list = []
        if plan.prelaunch and self._may_prelaunch(plan.requests, plan.plain):
            next_depth = self.policy.next_depth(plan.R)
            self._mark(next_marks)
            self.graphs.run(("draft", plan.R, next_depth), lambda: self._draft(b, next_depth))
            self._mark(next_marks)
            self._pending, self._pending_depth = b, next_depth
        return next_marks

    def _synchronise(self, done, marks: list, queued: tuple, drafted: bool,
                     t_start: float) -> tuple[list[float], float, float]:
        """The round's one synchronisation; ``(ms per phase, the seconds of the last call's
        queued draft that join this round's wall time, the ms of it hidden behind the host)``."""
        if self.cuda:
            done.synchronize()                   # the round's one synchronisation
        ms = [self._elapsed(marks[i], marks[i + 1]) for i in range(3)]
        # a draft queued by the last call ran (partly) between the two calls: its device time is
        # this round's draft (added to a fresh one when the rows changed under it), and the
        # part that fell between the calls joins this round's wall time
        carry = hidden = 0.0
        if queued:
            q_marks, q_start, q_return = queued
            q_ms = self._elapsed(*q_marks)
            ms[0] = q_ms if drafted else ms[0] + q_ms
            # on the CPU it ran inside the last call (whose time left it out): all of it
            carry = max(0.0, min(q_start + q_ms / 1e3, t_start) - q_return) if self.cuda else \
                q_ms / 1e3
            # what ran while the last call still read its tokens is in no round's wall time
            if drafted and self.cuda:
                hidden = min(q_ms, 1e3 * max(0.0, q_return - q_start))
        return ms, carry, hidden

    def _kept(self, plan: RoundPlan, b: RoundBuffers) -> tuple[list[int], int | None]:
        """Each request's emitted count; a shared budget's kept counts go to the policy.
        ``(counts, draft nodes verified past the roots or None)``."""
        requests = plan.requests
        counts = b.num_host[:len(requests)].tolist()
        draft_nodes = None
        if self.policy.shared and not plan.plain:
            kept = b.kept_host[:len(requests)].tolist()
            widen = bool(b.widen_host) if plan.chose else None
            # the next width follows the rows that drafted whole trees: one near its token limit
            # drafts a shallower tree, whose count says nothing of the next request's
            grown = [k for k, r in zip(kept, requests) if r.remaining > self.D]
            self.policy.observe(plan.R, grown, plan.kind, widen)
            draft_nodes = sum(min(k, plan.width) - 1 for k in kept)      # past the roots
        return counts, draft_nodes

    def _emit(self, plan: RoundPlan, b: RoundBuffers, counts: list[int]):
        """``(each request's new tokens, their logprobs or None)``; the cache's lengths advance
        and a host drafter commits them too."""
        requests = plan.requests
        emitted = b.emitted_host[:len(requests)].tolist()
        tokens = [row[:n] for row, n in zip(emitted, counts)]
        logprobs = b.logprobs.rows(counts, [r.params.logprobs for r in requests]) \
            if b.sampling.logprobs else [None] * len(requests)
        self.cache.advance([r.slot for r in requests], counts)
        if self.drafter is not None and not self.drafter.on_device:
            for r, toks in zip(requests, tokens):
                self.drafter.observe(r.slot, [r.out[-1]] + toks[:-1])
        return tokens, logprobs

    def _report(self, plan: RoundPlan, counts: list[int], timing: dict, hidden: float,
                depth: int, unmeasured: bool) -> None:
        """The goodput policy hears what this round delivered per request per ms, over the
        requests whose whole tree could be accepted (one near its token limit drafts a
        shallower tree: its tokens say nothing of what drafting delivers, while a plain
        round's say everything); ``unmeasured``: the round's time holds a graph capture or a
        dropped queued draft."""
        plain, total = plan.plain, timing["total"]
        full = [c for c, r in zip(counts, plan.requests) if plain or r.remaining > self.D]
        measured = bool(full) and not unmeasured
        self.policy.after_round(plan.R, plain, timing["draft"], timing["accept_commit"],
                                sum(full) / (max(len(full), 1) * max(total, 1e-6)),
                                host_ms=timing["host"], measured=measured)
        if plan.kind == "whole":
            self.policy.after_whole(plan.R, depth, [c - 1 for c in full], timing["draft"],
                                    total - (timing["draft"] - hidden), measured, hidden)

    def _may_prelaunch(self, requests, plain: bool) -> bool:
        """Whether the next round's draft can be queued now: the device drafter grows it, this
        round drafted and is not goodput's look (after a look the next round is as likely
        plain; after other rounds it may still be, if this one decides so: the queued draft is
        then dropped, its time counted in the plain round, which goodput does not average),
        and no request can reach its token limit in this round."""
        return (self.device_drafter is not None and not plain and not self.policy.looking
                and all(r.remaining > self.D + 1 for r in requests))
