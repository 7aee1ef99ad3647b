"""`bole demo`, part 1: the bundled model writes code with MTP-drafted tree speculation, checked
token for token against plain decoding, with the speculative statistics."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from bole.assets import BUNDLED_MODEL
from bole.engine.spec import DEFAULT_TREE


def run(model_dir: str | Path = BUNDLED_MODEL, prompt: str | None = None, max_tokens: int = 96,
        depth: int = DEFAULT_TREE[0], topk: int = DEFAULT_TREE[1],
        budget: int = DEFAULT_TREE[2]) -> dict:
    """Generate from ``prompt`` in ``bole`` mode and in ``ar`` mode (greedy, fp32 on the CPU or
    bf16 on a GPU), with the tree that generate, serve and LLM default to; print the text and
    both runs' statistics. Returns the statistics."""
    from tokenizers import Tokenizer

    from bole.assets import code_prompts
    from bole.engine import Engine, SamplingParams, SpecConfig, default_drafter
    from bole.speculative.drafters.registry import drafter_info
    from bole.models.qwen3_hybrid import HybridModel

    model_dir = Path(model_dir)
    prompt = prompt if prompt is not None else code_prompts()[0]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = HybridModel.from_pretrained(model_dir, dtype=dtype, device=device)
    drafter = default_drafter(model)
    ids = tok.encode(prompt).ids
    # one function: stop where the next top-level definition would begin
    params = SamplingParams(max_tokens=max_tokens, stop=("\ndef ", "\nclass ", "\nif __name__"))
    runs = {}
    for mode in ("bole", "ar"):
        spec = SpecConfig(mode, drafter, depth, topk, budget)
        engine = Engine(model, spec, max_slots=1, tokenizer=tok,
                        max_len=len(ids) + max_tokens + max(spec.nodes_per_request, depth + 1) + 1)
        engine.generate([ids], SamplingParams(max_tokens=4, ignore_eos=True))    # warm-up
        t0 = time.perf_counter()
        result = engine.generate([ids], params)[0]
        runs[mode] = (result, time.perf_counter() - t0, engine.text(result, params))
    (spec, spec_s, text), (ar, ar_s, _) = runs["bole"], runs["ar"]
    who = "the bundled model" if model_dir.resolve() == BUNDLED_MODEL.resolve() else model_dir.name
    source = drafter_info(drafter).help
    print(f"Bole demo 1/2: {who} ({device}, {str(dtype)[6:]}) continues a prompt; {source} drafts "
          f"a depth-{depth}, top-{topk} tree of up to {budget} nodes per round\n")
    print(prompt + text)
    stats = dict(tokens=len(spec.token_ids), rounds=spec.rounds,
                 mean_accepted_tokens=spec.mean_accepted_tokens,
                 tokens_per_s=len(spec.token_ids) / spec_s, ar_tokens_per_s=len(ar.token_ids) / ar_s,
                 identical_to_ar=spec.token_ids == ar.token_ids)
    print(f"\n[bole] {stats['tokens']} tokens in {stats['rounds']} verify rounds: "
          f"{stats['mean_accepted_tokens']:.2f} tokens per round (plain decoding: 1), "
          f"{stats['tokens_per_s']:.0f} tokens/s (plain decoding {stats['ar_tokens_per_s']:.0f}); "
          f"output identical to plain greedy decoding: {'yes' if stats['identical_to_ar'] else 'NO'}\n")
    if not stats["identical_to_ar"] and dtype == torch.float32:
        raise SystemExit("greedy speculative output differs from plain decoding in fp32: a bug")
    return stats
