"""The ``bole`` command line."""

from __future__ import annotations

import argparse
import sys

from bole.assets import BUNDLED_MODEL
from bole.config import GDN_SHAPES


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bole", description="Exact tree speculative decoding "
                                     "for hybrid-attention (Gated DeltaNet) LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the bundled model writes code with tree speculation "
                          "(statistics against plain decoding), then random draft trees are "
                          "verified exactly on one GDN layer of a real model's shape")
    demo.add_argument("--shape", default="qwen3.5-9b", choices=sorted(GDN_SHAPES),
                      help="model whose GDN layer shape to use (default: qwen3.5-9b)")
    demo.add_argument("--nodes", type=int, nargs="+", default=[64, 128],
                      help="tree sizes to verify (default: 64 128)")
    demo.add_argument("--depth", type=int, default=8, help="maximum tree depth (default: 8)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--model", default=str(BUNDLED_MODEL),
                      help="checkpoint folder for the generation part (default: the bundled model)")
    demo.add_argument("--prompt", default=None, help="default: a bundled Python prompt")
    demo.add_argument("--max-tokens", type=int, default=96)
    demo.add_argument("--no-generate", action="store_true", help="only the GDN-layer part")
    gen = sub.add_parser("generate", help="generate text from a checkpoint folder; the text goes "
                         "to stdout, statistics to stderr")
    gen.add_argument("--model", default=str(BUNDLED_MODEL),
                     help="checkpoint folder (config.json, safetensors, tokenizer.json); "
                          "default: the bundled model")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--mode", default="bole", choices=["ar", "bole", "tree-serial", "chain"])
    gen.add_argument("--drafter", default=None, choices=["ngram", "mtp", "draft"],
                     help="draft source (default: the checkpoint's MTP head when it has one, "
                          "else n-gram lookup; 'draft' needs --draft-model)")
    gen.add_argument("--draft-model", default=None,
                     help="checkpoint folder of a separate draft model (same tokenizer)")
    gen.add_argument("--depth", type=int, default=8)
    gen.add_argument("--topk", type=int, default=4)
    gen.add_argument("--budget", type=int, default=32, help="draft-tree nodes per request")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (text, token_ids, rounds, mean_accepted_tokens, "
                          "tokens_per_s) instead of the text")
    bench = sub.add_parser("bench", help="the same prompts through every mode side by side; "
                           "JSON and a plot under bench/results/")
    src = bench.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint folder (default: the bundled model)")
    src.add_argument("--preset", help="random weights of a preset (e.g. qwen3.5-9b, tiny)")
    bench.add_argument("--modes", nargs="+", default=["ar", "bole", "tree-serial", "chain"])
    bench.add_argument("--drafter", default=None, choices=["ngram", "mtp"],
                       help="default: the checkpoint's MTP head when it has one, else n-gram lookup")
    bench.add_argument("--prompt-set", default=None, choices=["code", "repetitive"],
                       help="code: the bundled Python prompts (needs the checkpoint's tokenizer; "
                            "default then); repetitive: repeated random phrases (default for presets)")
    bench.add_argument("--prompts", type=int, default=4, help="number of prompts")
    bench.add_argument("--prompt-len", type=int, default=64, help="length of repetitive prompts")
    bench.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"],
                       help="default: bf16 on a GPU, fp32 on the CPU")
    bench.add_argument("--max-tokens", type=int, default=64)
    bench.add_argument("--depth", type=int, default=8)
    bench.add_argument("--topk", type=int, default=4)
    bench.add_argument("--budget", type=int, default=32)
    bench.add_argument("--device", default=None)
    bench.add_argument("--out", default="bench/results")
    return parser


def _bench(args) -> int:
    from pathlib import Path

    import torch

    from bole.assets import code_prompts
    from bole.benchmark import repetitive_prompts, run_modes, write_results
    from bole.engine import default_drafter
    from bole.models.presets import preset_config
    from bole.models.qwen3_hybrid import HybridModel

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(
        args.dtype, torch.bfloat16 if device.startswith("cuda") else torch.float32)
    tokenizer = None
    if args.preset:
        model = HybridModel.random(preset_config(args.preset), dtype=dtype, device=device)
        name = f"{args.preset}-random"
    else:
        folder = Path(args.model or BUNDLED_MODEL)
        model = HybridModel.from_pretrained(folder, dtype=dtype, device=device)
        name = "bundled" if folder.resolve() == BUNDLED_MODEL.resolve() else folder.name
        if (folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer
            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    prompt_set = args.prompt_set or ("code" if tokenizer is not None else "repetitive")
    if prompt_set == "code":
        if tokenizer is None:
            raise ValueError("--prompt-set code needs a checkpoint folder with tokenizer.json")
        texts = code_prompts()
        prompts = [tokenizer.encode(texts[i % len(texts)]).ids for i in range(args.prompts)]
    else:
        prompts = repetitive_prompts(model.config.vocab_size, args.prompts, args.prompt_len)
    drafter = args.drafter or default_drafter(model)
    results = run_modes(model, prompts, args.modes, max_tokens=args.max_tokens, depth=args.depth,
                        topk=args.topk, budget=args.budget, drafter=drafter)
    meta = dict(model_name=name, device=torch.cuda.get_device_name() if device.startswith("cuda")
                else "cpu", torch=torch.__version__, dtype=str(dtype).replace("torch.", ""),
                prompts=args.prompts, prompt_set=prompt_set,
                prompt_len=args.prompt_len if prompt_set == "repetitive" else None,
                max_tokens=args.max_tokens, depth=args.depth, topk=args.topk, budget=args.budget,
                drafter=drafter)
    path, png = write_results(results, meta, Path(args.out))
    print(f"{name}, {meta['dtype']} on {meta['device']}, drafter {drafter}, {prompt_set} prompts")
    print(f"{'mode':<12} {'tokens/s':>9} {'tok/round':>9} {'fwd ms/round':>12} {'agree w/ ar':>11}")
    for r in results:
        agree = "-" if r.agreement_with_ar is None else f"{100 * r.agreement_with_ar:.0f}%"
        print(f"{r.mode:<12} {r.tokens_per_s:>9.1f} {r.mean_accepted_tokens:>9.2f} "
              f"{r.verify_ms_per_round:>12.2f} {agree:>11}")
    print(path)
    print(png)
    return 0


def _generate(args) -> int:
    import json
    import time
    from pathlib import Path

    import torch
    from tokenizers import Tokenizer

    from bole.engine import Engine, GenerationParams, SpecConfig, default_drafter
    from bole.models.qwen3_hybrid import HybridModel
    from bole.spec.sampling import SamplingParams

    folder = Path(args.model)
    tok_file = folder / "tokenizer.json"
    if not tok_file.is_file():
        raise ValueError(f"{tok_file} not found: bole generate needs the checkpoint's tokenizer")
    tokenizer = Tokenizer.from_file(str(tok_file))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = HybridModel.from_pretrained(folder, dtype=dtype, device=device)
    ids = tokenizer.encode(args.prompt).ids
    if not ids:
        raise ValueError("the prompt encodes to no tokens; give a non-empty prompt")
    params = GenerationParams(
        max_tokens=args.max_tokens, stop_token_ids=model.config.eos_token_id,
        stop_strings=tuple(args.stop),
        sampling=SamplingParams(args.temperature, args.top_k, args.top_p))
    draft_model = (HybridModel.from_pretrained(args.draft_model, dtype=dtype, device=device)
                   if args.draft_model else None)
    drafter = args.drafter or ("draft" if draft_model is not None else default_drafter(model))
    spec = SpecConfig(args.mode, drafter, args.depth, args.topk, args.budget)
    engine = Engine(model, spec, max_slots=1,
                    max_len=len(ids) + max(args.max_tokens, 1) + args.depth + 2, tokenizer=tokenizer,
                    draft_model=draft_model)
    t0 = time.perf_counter()
    result = engine.generate([ids], params, seed=args.seed)[0]
    elapsed = time.perf_counter() - t0
    text = engine.text(result, params)
    stats = dict(rounds=result.rounds, mean_accepted_tokens=result.mean_accepted_tokens,
                 tokens_per_s=len(result.token_ids) / elapsed)
    if args.json:
        print(json.dumps(dict(text=text, token_ids=result.token_ids, **stats)))
    else:
        print(text)
        print(f"[bole] {len(result.token_ids)} tokens in {elapsed:.2f} s ({stats['tokens_per_s']:.1f} "
              f"tokens/s), {result.rounds} rounds, {result.mean_accepted_tokens:.2f} tokens/round, "
              f"mode {args.mode}, finish: {result.finish_reason}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "demo":
        from bole import demo, generation_demo
        if any(n < 1 for n in args.nodes) or args.depth < 0 or args.max_tokens < 1:
            print("bole demo: --nodes and --max-tokens must be >= 1 and --depth >= 0", file=sys.stderr)
            return 2
        if not args.no_generate:
            generation_demo.run(args.model, args.prompt, args.max_tokens)
        demo.main(args.shape, tuple(args.nodes), args.depth, args.seed)
    elif args.command == "bench":
        try:
            return _bench(args)
        except ValueError as exc:
            print(f"bole bench: {exc}", file=sys.stderr)
            return 2
    elif args.command == "generate":
        try:
            return _generate(args)
        except (ValueError, FileNotFoundError) as exc:
            print(f"bole generate: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
