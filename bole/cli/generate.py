"""``bole generate``: one prompt through the engine; the text to stdout, statistics to stderr."""

from __future__ import annotations

import sys

from bole.cli.common import (UsageError, check_positive, checkpoint_folder, load_tokenizer,
                             pick_device, prefix_cache_from_args, read_prompt, spec_from_args)
from bole.speculative.drafters.registry import FALLBACK_DRAFTER


def _prompt_ids(args, tokenizer, folder) -> list[int]:
    """The prompt's token ids, checked to leave room for ``--max-tokens`` in the model's context
    (its first tokens dropped under ``--truncate-prompt``)."""
    from bole.models.config import HybridConfig
    context = HybridConfig.from_pretrained(folder).max_position_embeddings
    room = context - args.max_tokens - args.depth - 2
    if room < 1:
        raise UsageError(f"--max-tokens {args.max_tokens} leaves no room for a prompt in the "
                         f"model's context of {context} tokens; pass --max-tokens "
                         f"{context - args.depth - 3} or less")
    ids = tokenizer.encode(read_prompt(args)).ids
    if not ids:
        raise UsageError("the prompt encodes to no tokens; give a non-empty prompt")
    if len(ids) > room:
        if not args.truncate_prompt:
            raise UsageError(f"the prompt has {len(ids)} tokens, but the model's context of "
                             f"{context} leaves {room} for it with --max-tokens "
                             f"{args.max_tokens}; shorten it, lower --max-tokens or pass "
                             "--truncate-prompt (keeps its last tokens)")
        print(f"[bole] warning: --truncate-prompt dropped the prompt's first {len(ids) - room} "
              f"of {len(ids)} tokens (the context of {context} leaves {room} with --max-tokens "
              f"{args.max_tokens})", file=sys.stderr)
        ids = ids[-room:]
    return ids


def generate(args) -> int:
    import json
    import time

    import torch

    from bole.engine import Engine, SamplingParams, default_drafter
    from bole.models.qwen3_hybrid import HybridModel

    check_positive(max_tokens=args.max_tokens)
    # --seed goes to Engine.generate below (request 0 of a seeded batch), so a seed draws the
    # same tokens it always has
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, max_tokens=args.max_tokens,
        stop=tuple(args.stop), stop_token_ids=tuple(args.stop_token_id),
        ignore_eos=args.ignore_eos, logprobs=args.logprobs)
    try:
        params.validate()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    device = pick_device(args.device)
    folder = checkpoint_folder(args.model, need_tokenizer=True)
    if args.draft_model:
        checkpoint_folder(args.draft_model, need_tokenizer=False)
    spec_from_args(args, args.drafter or FALLBACK_DRAFTER)
    tokenizer = load_tokenizer(folder)
    ids = _prompt_ids(args, tokenizer, folder)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = HybridModel.from_pretrained(folder, dtype=dtype, device=device,
                                        tp=getattr(args, "tp_group", None))
    draft_model = (HybridModel.from_pretrained(args.draft_model, dtype=dtype, device=device)
                   if args.draft_model else None)
    drafter = args.drafter or default_drafter(model, draft_model)
    spec = spec_from_args(args, drafter)
    engine = Engine(model, spec, max_slots=1, tokenizer=tokenizer, draft_model=draft_model,
                    max_len=len(ids) + args.max_tokens + max(spec.nodes_per_request,
                                                             args.depth + 1) + 1,
                    prefix_cache=prefix_cache_from_args(args))
    if len(ids) > 2048:                          # long prompts: show the prefill's progress
        def progress(done, total):
            print(f"\r[bole] prefill {done}/{total} tokens", end="" if done < total else "\n",
                  file=sys.stderr, flush=True)
        engine.on_prefill_chunk = progress
    t0 = time.perf_counter()
    result = engine.generate([ids], params, seed=args.seed)[0]
    elapsed = time.perf_counter() - t0
    text = engine.text(result, params)
    decode_tps = (len(result.token_ids) - 1) / max(result.decode_s, 1e-9)
    stats = dict(rounds=result.rounds, mean_accepted_tokens=result.mean_accepted_tokens,
                 tokens_per_s=decode_tps, finish_reason=result.finish_reason, mode=args.mode,
                 drafter=drafter, prefill_s=result.prefill_s, decode_s=result.decode_s,
                 elapsed_s=elapsed)
    if args.json:
        extra = {} if result.logprobs is None else dict(logprobs=[
            dict(token_id=lp.token_id, logprob=lp.logprob, top=[list(t) for t in lp.top])
            for lp in result.logprobs])
        print(json.dumps(dict(text=text, token_ids=result.token_ids, **stats, **extra)))
    else:
        print(text)
    print(f"[bole] {len(result.token_ids)} tokens: first after {1e3 * result.prefill_s:.0f} ms "
          f"(prefill of {len(ids)}), then {decode_tps:.1f} tokens/s; {result.rounds} rounds, "
          f"{result.mean_accepted_tokens:.2f} tokens/round, mode {args.mode}, drafter "
          f"{drafter}, finish: {result.finish_reason}", file=sys.stderr)
    return 0
