"""`bole bench`: the same prompts through every mode, side by side (tokens/s, accepted tokens per
round, verify time per round), with greedy outputs checked against plain decoding."""

from __future__ import annotations

import datetime as _dt
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bole.engine import MODES, Engine, GenerationParams, SpecConfig
from bole.models.qwen3_hybrid import HybridModel


@dataclass
class ModeResult:
    mode: str
    tokens: int
    seconds: float
    tokens_per_s: float
    rounds: int
    mean_accepted_tokens: float
    verify_ms_per_round: float
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
              drafter: str = "ngram") -> list[ModeResult]:
    params = GenerationParams(max_tokens=max_tokens)
    max_len = max(len(p) for p in prompts) + max_tokens + depth + 2
    outputs, results = {}, []
    for mode in modes:
        engine = Engine(model, SpecConfig(mode=mode, drafter=drafter, depth=depth, topk=topk,
                                          budget=budget),
                        max_slots=len(prompts), max_len=max_len)
        # warm-up on the same prompts: kernels compile for the tree sizes this run will see
        engine.generate(prompts, GenerationParams(max_tokens=min(max_tokens, 2 * depth + 2)), seed=seed)
        engine.stats.update(forward_s=0.0, rounds=0)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = engine.generate(prompts, params, seed=seed)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        outputs[mode] = [r.token_ids for r in res]
        tokens = sum(len(r.token_ids) for r in res)
        rounds = sum(r.rounds for r in res)
        accepted = sum(sum(r.accepted) for r in res)
        agree = None
        if "ar" in outputs and mode != "ar":
            agree = sum(a == b for a, b in zip(outputs["ar"], outputs[mode])) / len(prompts)
        results.append(ModeResult(
            mode, tokens, elapsed, tokens / elapsed, engine.stats["rounds"],
            accepted / max(1, rounds), 1e3 * engine.stats["forward_s"] / max(1, engine.stats["rounds"]),
            agree))
    return results


def write_results(results: list[ModeResult], meta: dict, out_dir: Path) -> tuple[Path, Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    date = _dt.date.today().isoformat()
    where = "cpu" if meta.get("device", "cpu") == "cpu" else "cuda"
    stem = f"bench-{date}-{meta.get('model_name', 'model')}-{meta.get('dtype', '')}-{where}"
    path = out_dir / f"{stem}.json"      # names may hold dots (qwen3.5-9b): no with_suffix
    path.write_text(json.dumps(dict(meta=dict(meta, date=date),
                                    results=[asdict(r) for r in results]), indent=1))
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    names = [r.mode for r in results]
    for ax, key, label in zip(axes, ("tokens_per_s", "mean_accepted_tokens", "verify_ms_per_round"),
                              ("tokens / s", "tokens per round", "forward ms per round")):
        ax.bar(names, [getattr(r, key) for r in results], color="tab:blue")
        ax.set_title(label, fontsize=9)
    fig.suptitle(f"{meta.get('model_name')} on {meta.get('device')}, {date}", fontsize=9)
    fig.tight_layout()
    png = out_dir / f"{stem}.png"
    fig.savefig(png, dpi=110)
    return path, png
