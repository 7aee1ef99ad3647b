"""Greedy agreement of the speculative modes with plain decoding in bf16 on the GPU, explained
(issue 5).

In exact arithmetic every mode emits ar's tokens (tested in fp32). In bf16 the modes run different
kernels (bole: the closed form; tree-serial and chain: the node-by-node kernel; the prefill: fla's
chunk kernel or not), so logits differ by rounding and a near-tie can flip an argmax, after which
the continuations differ. This script measures that: for each mode it finds the first position where
its tokens leave ar's, and asks the fp32 model (teacher-forced on the shared prefix) how close the
two candidate tokens were there: the top-1/top-2 logit gap at divergences against the gap at all
positions. As a control it runs ar itself with the serial GDN kernel instead of the closed form.

    python bench/bf16_agreement.py          # on a GPU -> bench/results/bf16-agreement-<date>.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# Run by path, Python puts bench/ first on sys.path: drop it, so that bench's modules are reached
# as bench.<name> and can never shadow, or be shadowed by, an installed package of the same name.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench")]

from bole.assets import BUNDLED_MODEL, code_prompts  # noqa: E402
from bole.engine import Engine, SamplingParams, SpecConfig, default_drafter  # noqa: E402
from bole.engine.runner import ModelRunner  # noqa: E402
from bole.models.qwen3_hybrid import HybridModel  # noqa: E402


def generate(model, prompts, mode: str, max_tokens: int, gdn_backend: str | None = None):
    drafter = default_drafter(model)
    engine = Engine(model, SpecConfig(mode=mode, drafter=drafter, depth=8, topk=4, budget=32),
                    max_slots=len(prompts), max_len=max(map(len, prompts)) + max_tokens + 40,
                    gdn_backend=gdn_backend)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [r.token_ids for r in engine.generate(prompts, params)]


@torch.no_grad()
def teacher_forced_logits(model32, seq: list[int]) -> torch.Tensor:
    """fp32 logits of every position of ``seq`` (one prefill on the exact torch path)."""
    runner = ModelRunner(model32, model32.new_cache(1, len(seq) + 1), "torch")
    slot = runner.cache.allocate(len(seq))
    _, hidden = runner.prefill(slot, torch.tensor(seq))
    return model32.lm_head(hidden).float()


@torch.no_grad()
def fp32_gaps(model32, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Top-1 minus top-2 fp32 logit at each generated position, teacher-forced on ``tokens``."""
    logits = teacher_forced_logits(model32, prompt + tokens[:-1])[len(prompt) - 1:]
    top = logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).cpu()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(BUNDLED_MODEL))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cpu only for a smoke run (torch kernels)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a GPU (bf16 kernels); --device cpu for a smoke run", file=sys.stderr)
        return 2
    gpu = args.device == "cuda"
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    texts = code_prompts()
    prompts = [tok.encode(texts[i % len(texts)] + "    " * (i // len(texts))).ids
               for i in range(args.prompts)]
    model = HybridModel.from_pretrained(args.model, dtype=torch.bfloat16, device=args.device)
    model32 = HybridModel.from_pretrained(args.model, dtype=torch.float32, device=args.device,
                                          gdn_backend="torch")
    for layer_type in model32.linear.values():  # the exact tree path, no tf32 chunk kernel
        layer_type.prefill_kernel = None
    ar = generate(model, prompts, "ar", args.max_tokens)
    runs = {"ar (serial GDN kernel)": generate(model, prompts, "ar", args.max_tokens,
                                               "triton-serial" if gpu else "torch-serial")}
    for mode in ("bole", "tree-serial", "chain"):
        runs[mode] = generate(model, prompts, mode, args.max_tokens)
    all_gaps = torch.cat([fp32_gaps(model32, p, t) for p, t in zip(prompts, ar)])
    report = dict(meta=dict(model=Path(args.model).name,
                            device=torch.cuda.get_device_name() if gpu else "cpu",
                            torch=torch.__version__, date=_dt.date.today().isoformat(),
                            prompts=len(prompts), max_tokens=args.max_tokens),
                  fp32_gap_all_positions=dict(median=float(all_gaps.median()),
                                              share_below_0_1=float((all_gaps < 0.1).float().mean())),
                  modes={})
    for name, outs in runs.items():
        divergences = []
        for p, a, b in zip(prompts, ar, outs):
            i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if i is None:
                continue
            gaps = fp32_gaps(model32, p, a[:i + 1])
            logits = teacher_forced_logits(model32, p + a[:i])[-1]
            top2 = logits.topk(2).indices.tolist()
            divergences.append(dict(position=i, fp32_gap=float(gaps[i]),
                                    tokens_are_fp32_top2=sorted(top2) == sorted([a[i], b[i]])))
        report["modes"][name] = dict(
            agreement=sum(a == b for a, b in zip(ar, outs)) / len(prompts),
            divergences=divergences,
            median_fp32_gap_at_divergence=(statistics.median(d["fp32_gap"] for d in divergences)
                                           if divergences else None))
    date = report["meta"]["date"]
    out = Path(args.out or os.environ.get("OUT") or ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bf16-agreement-{date}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"fp32 top-1/top-2 logit gap over all ar positions: median "
          f"{report['fp32_gap_all_positions']['median']:.3f}")
    for name, m in report["modes"].items():
        gap = m["median_fp32_gap_at_divergence"]
        print(f"{name:<24} agreement {100 * m['agreement']:5.1f}%  divergences {len(m['divergences']):2d}"
              f"  median fp32 gap there {'-' if gap is None else f'{gap:.3f}'}  top-2 pair "
              f"{sum(d['tokens_are_fp32_top2'] for d in m['divergences'])}/{len(m['divergences'])}")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
