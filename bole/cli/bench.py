"""``bole bench``: the same prompts through every mode side by side (bole/bench/modes.py)."""

from __future__ import annotations

from pathlib import Path

from bole.cli.common import (UsageError, check_positive, load_model, load_tokenizer, pick_device,
                             spec_from_args)
from bole.speculative.drafters.registry import FALLBACK_DRAFTER, drafter_info


def bench(args) -> int:
    import torch

    from bole.assets import code_prompts
    from bole.bench.modes import repetitive_prompts, run_modes, write_results
    from bole.engine import default_drafter

    check_positive(prompts=args.prompts, max_tokens=args.max_tokens, prompt_len=args.prompt_len)
    for b in args.batches or ():
        check_positive(batches=b)
    device = pick_device(args.device)
    args.mode = "bole"
    spec = spec_from_args(args, args.drafter or FALLBACK_DRAFTER)
    drafter_needs = drafter_info(spec.drafter)
    if args.forced_acceptance and not drafter_needs.replays_continuation:
        raise UsageError("--forced-acceptance replays a known continuation: it needs "
                         "--drafter replay")
    if drafter_needs.needs_acceptance_profile:
        from bole.speculative.drafters.replay import AcceptanceProfile
        try:
            AcceptanceProfile.load(args.acceptance or "")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(
        args.dtype, torch.bfloat16 if device.startswith("cuda") else torch.float32)
    tokenizer = None
    model, name, folder = load_model(args, device, dtype, mtp=args.drafter is not None
                                     and drafter_needs.on_device)
    if folder is not None:
        if (folder / "tokenizer.json").is_file():
            tokenizer = load_tokenizer(folder)
    prompt_set = args.prompt_set or ("code" if tokenizer is not None else "repetitive")
    if prompt_set == "code":
        if tokenizer is None:
            raise UsageError("--prompt-set code needs a checkpoint folder with tokenizer.json")
        texts = code_prompts()
        prompts = [tokenizer.encode(texts[i % len(texts)]).ids for i in range(args.prompts)]
    else:
        prompts = repetitive_prompts(model.config.vocab_size, args.prompts, args.prompt_len)
    drafter = args.drafter or default_drafter(model)
    results = run_modes(model, prompts, args.modes, max_tokens=args.max_tokens, depth=args.depth,
                        topk=args.topk, budget=args.budget, drafter=drafter,
                        batches=tuple(args.batches) if args.batches else None,
                        cuda_graphs=False if args.no_graphs else None, progress=True,
                        acceptance=args.acceptance, draft_vocab=args.draft_vocab,
                        forced_acceptance=args.forced_acceptance,
                        budget_policy=spec.budget_policy, shared_budget=spec.shared_budget,
                        root_floor=spec.root_floor, budget_eps=spec.budget_eps)
    import triton
    meta = dict(model_name=name, device=torch.cuda.get_device_name() if device.startswith("cuda")
                else "cpu", torch=torch.__version__, triton=triton.__version__,
                dtype=str(dtype).replace("torch.", ""), prompts=args.prompts,
                prompt_set=prompt_set,
                prompt_len=args.prompt_len if prompt_set == "repetitive" else None,
                max_tokens=args.max_tokens, depth=args.depth, topk=args.topk, budget=args.budget,
                drafter=drafter, acceptance=args.acceptance, draft_vocab=args.draft_vocab,
                forced_acceptance=args.forced_acceptance, budget_policy=spec.budget_policy,
                shared_budget=spec.shared_budget, root_floor=spec.root_floor,
                budget_eps=spec.budget_eps,
                cuda_graphs=not args.no_graphs and device.startswith("cuda"))
    path, png = write_results(results, meta, Path(args.out), args.tag)
    print(f"{name}, {meta['dtype']} on {meta['device']}, drafter {drafter}, {prompt_set} prompts")
    print("tok/s: every token over the run, prefills included; decode: tokens after each "
          "request's first over the rounds' time")
    print(f"{'mode':<12} {'batch':>5} {'tok/s':>8} {'decode':>8} {'x ar':>5} {'tok/rnd':>7} "
          f"{'rnd ms':>7} {'draft':>6} {'verify':>6} {'acc+cm':>6} {'host':>6} {'syncs':>5} "
          f"{'eager':>5} {'agree':>5}")
    ar_decode = {r.batch: r.decode_tokens_per_s for r in results if r.mode == "ar"}
    for r in results:
        agree = "-" if r.agreement_with_ar is None else f"{100 * r.agreement_with_ar:.0f}%"
        speedup = (f"{r.decode_tokens_per_s / ar_decode[r.batch]:.2f}" if r.batch in ar_decode
                   else "-")
        print(f"{r.mode:<12} {r.batch:>5} {r.tokens_per_s:>8.1f} {r.decode_tokens_per_s:>8.1f} "
              f"{speedup:>5} {r.mean_accepted_tokens:>7.2f} "
              f"{r.round_ms:>7.2f} {r.draft_ms:>6.2f} {r.verify_ms:>6.2f} "
              f"{r.accept_commit_ms:>6.2f} {r.host_ms:>6.2f} {r.syncs_per_round:>5.1f} "
              f"{r.eager_fallbacks:>5} {agree:>5}")
    print(f"wrote {path.resolve()}")
    print(f"wrote {png.resolve()}")
    return 0
