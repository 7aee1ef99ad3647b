"""The speculative round for a batch of requests: draft -> verify -> accept -> commit.

Modes, all with the same drafter and the same trees so that they differ only in verification and
state handling:

    ar           no speculation: one token per request per forward, no drafter work at all
    bole         draft trees; closed-form GDN verification, factors, one factored commit
    tree-serial  the same trees; node-by-node GDN with a state snapshot per node, copy commit
    chain        a single path of ``depth`` drafts (top-1), snapshot per position, copy commit

A round runs on the device in fixed shapes (a batch bucket of R rows x T node slots): the MTP
head grows every request's tree, the target verifies the forest, acceptance and the commit follow,
and the host learns each request's new tokens in one copy, the round's one synchronisation
(:mod:`bole.engine.round`). Requests run in slots of one cache; a request that stops (max tokens,
a stop token or string) leaves the batch and frees its slot at the end of that round while the
others go on. The node budget is per request; the calibrated batch-shared budget is separate."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Sequence

import torch

from bole.engine.prefix_admission import PrefixAdmission, PrefixCacheConfig
from bole.engine.request import (EngineInfo, GenerationResult, Request, SamplingParams,
                                 TokenLogprob, result_text)
from bole.engine.round import RoundRunner
from bole.engine.runner import PREFILL_BATCH_MAX, PREFILL_BATCH_ROWS, ModelRunner, prefill_bucket
from bole.engine.spec import SpecConfig
from bole.engine.timings import RoundTimings
from bole.models.qwen3_hybrid import HybridModel
from bole.speculative.accept_device import sample_rows
from bole.speculative.budget.registry import policy_info
from bole.speculative.drafters import registry as drafters
from bole.sampling_params import MAX_LOGPROBS, SEED_END, SEED_MIN
from bole.speculative.sampling import penalize_params, target_probs

__all__ = ["Engine"]


class Engine:
    """Generates for token-id prompts with one of the four modes."""

    def __init__(self, model: HybridModel, spec: SpecConfig = SpecConfig(), *,
                 max_slots: int = 8, max_len: int = 4096, tokenizer=None,
                 draft_model: HybridModel | None = None, cuda_graphs: bool | None = None,
                 progress: bool = False, gdn_backend: str | None = None,
                 budget_profile=None, prefix_cache: PrefixCacheConfig | None = None):
        """``gdn_backend`` overrides the mode's GDN backend (an oracle: ar on the serial
        reference recurrence checks the closed form end to end). ``budget_profile``: the
        calibration profile of the calibrated and goodput budget policies, measured for this
        spec's tree size (else the one saved for this GPU, model, dtype, versions and tree size
        is loaded, and calibrated first when there is none). ``prefix_cache``: keep the state of
        committed prefixes and restore it into later requests with the same prompt start
        (:mod:`bole.engine.prefix_admission`); None: off."""
        spec.validate()
        self.model, self.spec, self.tokenizer = model, spec, tokenizer
        on_gpu = model.device.type == "cuda"
        gdn = {"closed": ("torch", "triton"), "serial": ("torch-serial", "triton-serial"),
               "decode": ("torch-decode", "triton-decode")}
        self.cache = model.new_cache(max_slots, max_len)
        self.runner = ModelRunner(model, self.cache, gdn_backend or gdn[spec.gdn][on_gpu])
        if (drafters.drafter_info(spec.drafter).needs_draft_model and draft_model is None
                and spec.mode != "ar"):
            raise ValueError(f"the {spec.drafter} drafter needs a draft_model (--draft-model)")
        policy = policy_info(spec.budget_policy)
        if policy.host_timed and spec.mode != "ar" and model.tp.world > 1:
            raise ValueError(f"the {spec.budget_policy} policy decides each round on each "
                             "rank's host from its own timings, which tensor-parallel ranks "
                             "must not do apart: use --budget-policy fixed, global or "
                             "calibrated with --tp")
        if policy.needs_profile and spec.mode != "ar" and budget_profile is None:
            from bole.engine.calibrate import load_or_calibrate
            budget_profile = load_or_calibrate(model, spec, max_slots)
        if spec.budget_eps is not None and budget_profile is not None:
            budget_profile = budget_profile.at_eps(spec.budget_eps)
        self.rounds = RoundRunner(self.runner, spec, max_slots=max_slots,
                                  budget_profile=budget_profile,
                                  draft_model=draft_model if spec.mode != "ar" else None,
                                  cuda_graphs=on_gpu if cuda_graphs is None else cuda_graphs,
                                  progress=progress)
        self.timings = RoundTimings()
        #: ``on_prefill_chunk(done, total)`` after every prefill chunk (progress of long prompts)
        self.on_prefill_chunk = None
        if prefix_cache is not None and model.tp.world > 1:
            raise ValueError("the prefix cache is not supported with tensor parallelism yet: "
                             "turn it off (--no-prefix-cache) with --tp")
        #: admission through the prefix cache (None: off)
        self.prefix = PrefixAdmission(self, prefix_cache) if prefix_cache is not None else None

    @property
    def scratch(self) -> int:
        """Cache rows past a request's tokens that a round writes into."""
        return self.rounds.scratch

    # ---- requests ----
    @property
    def info(self) -> "EngineInfo":
        return EngineInfo(self.spec, self.cache.max_len, self.scratch,
                          self.model.config.vocab_size,
                          tuple(self.model.config.eos_token_id), self.tokenizer is not None)

    def check_request(self, prompt: Sequence[int], params: SamplingParams,
                      name: str = "the prompt") -> None:
        """Raise a ValueError naming what is wrong with one request (nothing is allocated)."""
        self.info.check_request(prompt, params, name)

    def new_request(self, index: int, prompt: Sequence[int], params: SamplingParams) -> Request:
        """A request not yet admitted (no slot); its sampling draws come from its own generator,
        seeded by ``params.seed`` (random when None), so they do not depend on the batch around
        it. It stops at ``params.all_stop_token_ids`` of the checkpoint's end-of-sequence
        tokens."""
        gen = torch.Generator(device=self.model.device)
        if params.seed is None:
            gen.seed()
        else:
            gen.manual_seed(params.seed)
        stops = params.all_stop_token_ids(self.model.config.eos_token_id)
        return Request(index, [int(t) for t in prompt], params, slot=-1, gen=gen,
                       stop_ids=frozenset(stops))

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 seed: int | None = None,
                 continuations: Sequence[Sequence[int]] | None = None) -> list[GenerationResult]:
        """Generate for every prompt through the continuous-batching scheduler: requests beyond
        the free slots wait, and each finished request leaves the batch and frees its slot while
        the others go on. Request i's sampling is seeded by its ``params.seed``, else by
        ``(seed, i)``. ``continuations``: plain decoding's output per prompt, for the replay
        drafter."""
        from bole.engine.scheduler import Scheduler
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} parameter sets for {len(prompts)} prompts")
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            self.check_request(prompt, p, f"prompt {i}")
        if seed is None and self.model.tp.world > 1:
            # tensor-parallel ranks must draw alike: rank 0's random seed for every rank
            import random
            seed = self.model.tp.broadcast_int(random.randrange(2 ** 31))
        scheduler = Scheduler(self, max_queue=max(1, len(prompts)))
        handles = [scheduler.submit(p, q if seed is None or q.seed is not None else
                                    replace(q, seed=_derived_seed(seed, i)), checked=True)
                   for i, (p, q) in enumerate(zip(prompts, params))]
        for h, cont in zip(handles, continuations or []):
            h.request.continuation = [int(t) for t in cont]
        scheduler.run_until_idle()
        return [h.request.result for h in handles]

    def warm_up(self) -> None:
        """Admit and release throwaway requests once per batched-prefill width (16, 32, 64
        tokens), one and two at a time, so that the admission path's kernels compile at
        start-up rather than under load (a server's first admissions otherwise stall on
        Triton's compiler). Every slot it takes is freed. Nothing to do where the admissions
        are captured in CUDA graphs: their capture at start-up compiled them."""
        if self.rounds.graphs.enabled:
            return
        for T in sorted({prefill_bucket(n) for n in range(1, PREFILL_BATCH_MAX + 1)}):
            for R in (1, 2):
                if self.cache.max_len < T + 1 + self.scratch or self.cache.num_free < R:
                    continue
                requests = [self.new_request(-1 - i, [0] * T, SamplingParams(max_tokens=1))
                            for i in range(R)]
                try:
                    self.admit_many(requests)
                finally:
                    for r in requests:
                        self.release(r)

    def admit(self, r: Request) -> None:
        """Give a request a slot, prefill its prompt there and emit its first token."""
        self.admit_many([r])

    def admit_many(self, requests: Sequence[Request]) -> None:
        """Admit requests together: a slot each, the short prompts (up to
        :data:`~bole.engine.runner.PREFILL_BATCH_MAX` tokens) prefilled in forwards of up to
        :data:`~bole.engine.runner.PREFILL_BATCH_ROWS` rows (a CUDA graph each on the GPU),
        longer ones chunk by chunk; each emits its first token. On an error the caller releases
        them."""
        t0 = time.perf_counter()
        for r in requests:
            r.started = t0
            r.slot = self.cache.allocate(len(r.prompt) + r.params.max_tokens + self.scratch)
        # the prompts the prefix cache takes together (it batches what it can), the short
        # others together, long others one by one
        through_cache = [self._cached(r) for r in requests]
        cached = [r for r, c in zip(requests, through_cache) if c]
        others = [r for r, c in zip(requests, through_cache) if not c]
        short = [r for r in others if len(r.prompt) <= PREFILL_BATCH_MAX]
        groups = [part[i:i + PREFILL_BATCH_ROWS] for part in (cached, short)
                  for i in range(0, len(part), PREFILL_BATCH_ROWS)]
        groups += [[r] for r in others if len(r.prompt) > PREFILL_BATCH_MAX]
        for group in groups:
            prompts = [torch.tensor(r.prompt) for r in group]
            slots, continuations = [r.slot for r in group], [r.continuation for r in group]
            if self._cached(group[0]):
                logits = self.prefix.admit(group)
            elif len(group[0].prompt) <= PREFILL_BATCH_MAX:
                logits = self.rounds.prefill(slots, prompts, continuations)
            else:
                last, states = self.runner.prefill(group[0].slot, prompts[0],
                                                   on_chunk=self.on_prefill_chunk)
                logits = last[None]
                self.rounds.on_prefill(slots, prompts, [states], continuations)
            # the greedy first tokens in one read; sampled and penalised ones one by one
            greedy = logits.argmax(-1).tolist()
            for i, r in enumerate(group):
                sampling = r.params
                first = greedy[i] if sampling.greedy and not sampling.penalized else \
                    self._sample_one(penalize_params(logits[i], [], r.prompt, sampling),
                                     sampling, r.gen)
                if sampling.penalized:
                    self.rounds.start_penalties(r.slot, r.prompt, first)
                lp = None
                if r.params.logprobs is not None:
                    lp = [_token_logprob(logits[i], first, r.params.logprobs)]
                r.prefill_s = time.perf_counter() - t0
                self._emit(r, [first], rounds=0, logprobs=lp)

    def _cached(self, r: Request) -> bool:
        """Whether ``r`` is admitted through the prefix cache (a user's request, long enough)."""
        return self.prefix is not None and r.index >= 0 and self.prefix.takes(r)

    def release(self, r: Request) -> None:
        """Free a request's slot (and its drafter state)."""
        if r.slot >= 0 and r.slot in self.cache.used_slots:
            if self.prefix is not None and r.index >= 0:
                self.prefix.finish(r)
            self.rounds.on_release(r.slot)
            self.cache.free(r.slot)
        r.slot = -1

    def step(self, running: list[Request], prelaunch: bool = False) -> dict:
        """One speculative round over ``running``; their new tokens are appended. Returns the
        round's timings (ms). ``prelaunch``: the same requests are expected next round, so
        that round's draft may be queued now (:meth:`RoundRunner.run`): plan, round, emit."""
        result = self.rounds.run(self.rounds.plan(running, prelaunch))
        timing = result.timing
        self.timings.add(timing)
        for r, new, lp in zip(running, result.tokens, result.logprobs):
            self._emit(r, new, rounds=1,
                       logprobs=None if lp is None else
                       [TokenLogprob(t, v, tuple(top)) for t, (v, top) in zip(new, lp)])
        return timing

    def _sample_one(self, logits: torch.Tensor, sampling: SamplingParams,
                    gen: torch.Generator) -> int:
        if sampling.greedy:
            return int(logits.argmax())
        probs = target_probs(logits[None], sampling)
        u = torch.rand(1, generator=gen, device=logits.device)
        return int(sample_rows(probs, u)[0])

    def _emit(self, r: Request, new: list[int], rounds: int,
              logprobs: list[TokenLogprob] | None = None) -> None:
        """Append a round's tokens (and their ``logprobs``, one per token, when the request
        asked for them) up to a stop token or max_tokens; finish the request there."""
        stop = r.stop_ids
        before, reason = len(r.out), None
        for j, t in enumerate(new):
            r.out.append(t)
            if logprobs is not None:
                r.logprobs.append(logprobs[j])
            if t in stop:
                reason = "stop"
                break
            if len(r.out) >= r.params.max_tokens:
                reason = "length"
                break
        if r.params.stop:
            cut = self._stop_string_cut(r)
            if cut is not None:
                del r.out[cut:]
                del r.logprobs[cut:]
                reason = "stop"
        if rounds:
            r.rounds += 1
            r.accepted.append(len(r.out) - before)
        if reason is not None:
            elapsed = time.perf_counter() - r.started
            r.result = GenerationResult(list(r.out), reason, r.rounds, list(r.accepted),
                                        r.prefill_s, elapsed - r.prefill_s,
                                        list(r.logprobs) if r.params.logprobs is not None
                                        else None, r.cached_tokens)

    def _stop_string_cut(self, r: Request) -> int | None:
        """Fewest output tokens whose text contains a stop string, or None."""
        text = self.tokenizer.decode(r.out)
        if not any(stop in text for stop in r.params.stop):
            return None
        for m in range(1, len(r.out) + 1):
            if any(stop in self.tokenizer.decode(r.out[:m]) for stop in r.params.stop):
                return m
        return len(r.out)

    def text(self, result: GenerationResult, params: SamplingParams) -> str:
        """Decoded output (:func:`result_text`)."""
        return result_text(self.tokenizer, result, params)


def _derived_seed(seed: int, i: int) -> int:
    """Request ``i``'s seed from ``generate``'s ``seed``: ``seed * 1_000_003 + i``, wrapped into
    a torch generator's seeds when it falls outside them (a large ``--seed``), else as it is."""
    derived = seed * 1_000_003 + i
    return derived if SEED_MIN <= derived < SEED_END else derived % SEED_END


def _token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s log-probability under ``logits [V]`` and the ``top`` most likely tokens'
    (the computation of :class:`bole.engine.buffers.RoundLogprobs`, for one row)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(lp, min(MAX_LOGPROBS, lp.shape[-1]))
    ids, values = best.indices[:top].tolist(), best.values[:top].tolist()
    return TokenLogprob(token, float(lp[token]), tuple(zip(ids, values)))
