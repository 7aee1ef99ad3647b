"""`bole bench`: the same prompts through every mode side by side, at one or more batch sizes:
tokens/s, accepted tokens per round, the round's split (draft, verify, accept+commit, host),
host synchronisations per round, graph replays and eager fallbacks, and greedy agreement with
plain decoding."""

from __future__ import annotations

import datetime as _dt
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bole.engine import MODES, Engine, SamplingParams, SpecConfig
from bole.models.qwen3_hybrid import HybridModel
from bole.speculative.budget.registry import DEFAULT_POLICY
from bole.speculative.drafters.registry import FALLBACK_DRAFTER, drafter_info


@dataclass
class ModeResult:
    mode: str
    batch: int
    tokens: int
    seconds: float
    tokens_per_s: float                 # every token over the whole run, prefills included
    decode_tokens_per_s: float          # tokens after each request's first over the rounds' time
    prefill_s: float                    # the run's time outside rounds (admission, prefills)
    rounds: int
    mean_accepted_tokens: float
    round_ms: float
    draft_ms: float
    verify_ms: float
    accept_commit_ms: float
    host_ms: float
    gpu_idle_share: float
    syncs_per_round: float
    graph_replays: int
    eager_fallbacks: int
    agreement_with_ar: float | None     # share of requests whose greedy tokens equal ar's


def repetitive_prompts(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """Prompts made of a short random phrase repeated: text an n-gram drafter can continue."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        phrase = torch.randint(0, vocab, (4 + i % 5,), generator=gen).tolist()
        prompts.append((phrase * (length // len(phrase) + 1))[:length])
    return prompts


def run_modes(model: HybridModel, prompts: list[list[int]], modes=MODES, *, max_tokens: int = 64,
              depth: int = 8, topk: int = 4, budget: int = 32, seed: int = 0,
              drafter: str = FALLBACK_DRAFTER, batches: tuple[int, ...] | None = None,
              cuda_graphs: bool | None = None, progress: bool = False,
              acceptance: str | None = None, draft_vocab: int = 0,
              forced_acceptance: bool = False, budget_policy: str = DEFAULT_POLICY,
              shared_budget: int = 0, root_floor: int = 1,
              budget_eps: float | None = None) -> list[ModeResult]:
    """Every mode over ``prompts`` at each batch size (the prompts cycled to fill a batch; by
    default one batch of all of them). With the replay drafter, plain decoding runs first and
    its output is every other mode's known continuation. ``budget_policy``, ``shared_budget``,
    ``root_floor`` and ``budget_eps`` (:class:`SpecConfig`'s) apply to bole's rounds."""
    batches = batches or (len(prompts),)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)    # fixed-length runs
    results = []
    for batch in batches:
        work = [prompts[i % len(prompts)] for i in range(batch)]
        outputs: dict[str, list[list[int]]] = {}
        continuations = None
        if drafter_info(drafter).replays_continuation:
            ar_engine = Engine(model, SpecConfig(mode="ar"), max_slots=batch,
                               max_len=max(len(p) for p in work) + max_tokens + 2,
                               cuda_graphs=cuda_graphs)
            continuations = [r.token_ids for r in ar_engine.generate(work, params, seed=seed)]
            del ar_engine
        for mode in modes:
            if progress:
                print(f"\r[bole bench] batch {batch}: {mode:<12}", end="", file=sys.stderr,
                      flush=True)
            policy = dict(budget_policy=budget_policy, shared_budget=shared_budget,
                          root_floor=root_floor, budget_eps=budget_eps) if mode == "bole" else {}
            spec = SpecConfig(mode=mode, drafter=drafter, depth=depth, topk=topk, budget=budget,
                              acceptance=acceptance, draft_vocab=draft_vocab,
                              forced_acceptance=forced_acceptance and mode != "ar", **policy)
            scratch = max(spec.nodes_per_request, depth + 1)
            max_len = max(len(p) for p in work) + max_tokens + scratch + 1
            engine = Engine(model, spec, max_slots=batch, max_len=max_len,
                            cuda_graphs=cuda_graphs)
            # warm-up on the same prompts: kernels compile, buffers exist for this batch
            engine.generate(work, SamplingParams(max_tokens=min(max_tokens, 2 * depth + 2),
                                                 ignore_eos=True),
                            seed=seed, continuations=continuations)
            engine.timings = type(engine.timings)()
            stats = engine.rounds.graphs.stats
            replays0, fallbacks0 = stats["graph_replays"], stats["eager_fallbacks"]
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            res = engine.generate(work, params, seed=seed, continuations=continuations)
            elapsed = time.perf_counter() - t0
            outputs[mode] = [r.token_ids for r in res]
            tokens = sum(len(r.token_ids) for r in res)
            rounds = sum(r.rounds for r in res)
            accepted = sum(sum(r.accepted) for r in res)
            agree = None
            if "ar" in outputs and mode != "ar":
                agree = sum(a == b for a, b in zip(outputs["ar"], outputs[mode])) / batch
            split = engine.timings.summary()
            results.append(ModeResult(
                mode, batch, tokens, elapsed, tokens / elapsed,
                *engine.timings.decode_split(tokens - len(res), elapsed),
                engine.timings.rounds,
                accepted / max(1, rounds), split["round_ms"], split["draft_ms"],
                split["verify_ms"], split["accept_commit_ms"], split["host_ms"],
                split["gpu_idle_share"], split["syncs_per_round"],
                stats["graph_replays"] - replays0, stats["eager_fallbacks"] - fallbacks0, agree))
    if progress:
        print(file=sys.stderr)
    return results


def write_results(results: list[ModeResult], meta: dict, out_dir: Path,
                  tag: str = "") -> tuple[Path, Path]:
    """JSON and a plot under ``out_dir``; the stem carries the date, model, dtype, device and
    the time of day, so that no run overwrites another."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    now = _dt.datetime.now()
    date = now.date().isoformat()
    where = "cpu" if meta.get("device", "cpu") == "cpu" else "cuda"
    stem = (f"bench-{date}-{meta.get('model_name', 'model')}-{meta.get('dtype', '')}-{where}"
            f"{tag or now.strftime('-%H%M%S')}")
    path = out_dir / f"{stem}.json"      # names may hold dots (qwen3.5-9b): no with_suffix
    path.write_text(json.dumps(dict(meta=dict(meta, date=date),
                                    results=[asdict(r) for r in results]), indent=1))
    batches = sorted({r.batch for r in results})
    modes = list(dict.fromkeys(r.mode for r in results))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    width = 0.8 / len(modes)
    for ax, key, label in zip(axes, ("decode_tokens_per_s", "mean_accepted_tokens", "round_ms"),
                              ("decode tokens / s", "tokens per round", "ms per round")):
        for j, mode in enumerate(modes):
            xs = [i + j * width for i in range(len(batches))]
            ys = [next((getattr(r, key) for r in results if r.mode == mode and r.batch == b), 0)
                  for b in batches]
            bars = ax.bar(xs, ys, width, label=mode)
            ax.bar_label(bars, fmt="%.3g", fontsize=6)
        ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(batches))],
                      [f"batch {b}" for b in batches])
        ax.set_title(label, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{meta.get('model_name')} on {meta.get('device')}, {date}: "
                 f"{meta.get('prompts')} prompts, {meta.get('max_tokens')} tokens, drafter "
                 f"{meta.get('drafter')}, depth {meta.get('depth')} top-{meta.get('topk')} "
                 f"budget {meta.get('budget')}", fontsize=8)
    fig.tight_layout()
    png = out_dir / f"{stem}.png"
    fig.savefig(png, dpi=110)
    return path, png
