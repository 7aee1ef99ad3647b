"""Where a speculative round's device time goes, kernel by kernel (a probe for bench/NOTES.md).

Runs a generate on a random-weight preset with the replay drafter (as bench/e2e.py does), plain
decoding first, and profiles one live replay of each captured graph of the batch's bucket (draft,
verify, accept/commit), the first after ``--skip`` replays of it, while the run goes on: the
rounds are real (trees of full depth, live requests), only that round synchronises around each
profiled graph. Per graph: the kernels' summed ms, their span and the idle time between them
(launch gaps and tails), the kernel count, the kernels by name and in launch order with their
microseconds. Writes ``<out>/round-profile-<preset>-b<batch>.json``.

    python bench/round_profile.py --batch 8 --tree 8,2,16 --draft-vocab 32768   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Callable, Hashable

import torch

ROOT = Path(__file__).resolve().parents[1]
# Run by path, Python puts bench/ first on sys.path: drop it, so that bench's modules are reached
# as bench.<name> and can never shadow, or be shadowed by, an installed package of the same name.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench")]

from bench.e2e import load, prompts_for  # noqa: E402

from bole.engine import Engine, SamplingParams, SpecConfig  # noqa: E402
from bole.speculative.drafters.registry import drafter_info  # noqa: E402

PHASES = ("draft", "verify", "accept")


def cuda_kernels(fn: Callable[[], object]) -> tuple[object, list[tuple[str, float, float]]]:
    """``fn()``'s result and its kernels ``(name, start_us, duration_us)`` in start order."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    out = []
    for e in prof.events():
        if e.device_type.name != "CUDA" or "memcpy" in e.name.lower() or \
                "memset" in e.name.lower():
            continue
        start, end = float(e.time_range.start), float(e.time_range.end)
        out.append((e.name, start, end - start))
    return result, sorted(out, key=lambda k: k[1])


class LiveProfiler:
    """Wraps ``graphs.run`` (a :class:`bole.engine.graphs.GraphRunner`'s): the replay of a key
    of ``PHASES`` at ``batch`` that follows its first ``skip`` ones runs under ``kernels_fn``
    (:func:`cuda_kernels`), once per key; every other call passes straight through."""

    def __init__(self, graphs, batch: int, skip: int = 3, kernels_fn=cuda_kernels):
        self.batch, self.skip, self.kernels_fn = batch, skip, kernels_fn
        self.calls: dict[Hashable, int] = defaultdict(int)
        self.kernels: dict[Hashable, list[tuple[str, float, float]]] = {}
        self._run = graphs.run
        graphs.run = self.run

    def run(self, key, fn):
        if key[0] not in PHASES or key[1] != self.batch or key in self.kernels:
            return self._run(key, fn)
        self.calls[key] += 1
        if self.calls[key] <= self.skip:
            return self._run(key, fn)
        result, self.kernels[key] = self.kernels_fn(lambda: self._run(key, fn))
        return result


def summarise(key, ks: list[tuple[str, float, float]]) -> dict:
    busy = sum(d for _, _, d in ks)
    span = (ks[-1][1] + ks[-1][2] - ks[0][1]) if ks else 0.0
    by_name: dict[str, list[float]] = defaultdict(list)
    for name, _, d in ks:
        by_name[name[:90]].append(d)
    top = sorted(((n, len(v), sum(v)) for n, v in by_name.items()), key=lambda t: -t[2])
    return dict(key=str(key), kernel_ms=busy / 1e3, span_ms=span / 1e3,
                idle_ms=(span - busy) / 1e3, kernels=len(ks),
                by_name=[dict(name=n, count=c, us=round(t, 2)) for n, c, t in top],
                order=[(n[:60], round(d, 2)) for n, _, d in ks])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.5-9b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tree", default="8,2,16", help="depth,topk,budget")
    ap.add_argument("--draft-vocab", type=int, default=32768)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--skip", type=int, default=3,
                    help="replays of each graph before the one profiled")
    ap.add_argument("--out", default="/tmp/bole-runs")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    depth, topk, budget = map(int, args.tree.split(","))
    model, given, drafter, _ = load(args.model, "cuda", torch.bfloat16)
    prompts = prompts_for(model, given, args.batch, args.context, seed=args.batch)
    max_len = args.context + args.max_tokens + budget + depth + 2
    result = {}
    replays = drafter_info(drafter).replays_continuation
    for spec in (SpecConfig("ar"),
                 SpecConfig("bole", drafter, depth, topk, budget,
                            "qwen3-next-mtp" if replays else None,
                            draft_vocab=args.draft_vocab, forced_acceptance=replays)):
        engine = Engine(model, spec, max_slots=args.batch, max_len=max_len)
        cont = None
        if replays and spec.mode != "ar":
            cont = result["continuations"]
        live = LiveProfiler(engine.rounds.graphs, args.batch, args.skip)
        res = engine.generate(prompts,
                              SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
                              seed=0, continuations=cont)
        if spec.mode == "ar":
            result["continuations"] = [r.token_ids for r in res]
        result[spec.mode] = [summarise(k, ks) for k, ks in live.kernels.items()]
        for s in result[spec.mode]:
            print(f"{spec.mode} {s['key']}: span {s['span_ms']:.3f} ms, kernels {s['kernels']} "
                  f"busy {s['kernel_ms']:.3f} ms, idle {s['idle_ms']:.3f} ms", flush=True)
        del engine
    result.pop("continuations", None)
    result.update(model=args.model, batch=args.batch, tree=args.tree,
                  draft_vocab=args.draft_vocab, device=torch.cuda.get_device_name(),
                  torch=torch.__version__)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"round-profile-{args.model}-b{args.batch}.json"
    path.write_text(json.dumps(result, indent=1))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
