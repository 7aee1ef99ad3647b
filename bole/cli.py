"""The ``bole`` command line: demo, generate, bench, serve, calibrate (and bench-serve).

Arguments are checked before anything is loaded; every failure a user can cause ends with exit
code 2 and one line naming the problem and what to do (never a traceback).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bole.assets import BUNDLED_MODEL
from bole.config import GDN_SHAPES
from bole.engine.engine import DEFAULT_TREE, DRAFTERS, MAX_BUDGET, MAX_DEPTH, MAX_TOPK, MODES


#: drafters by command: generate and serve draft for real requests (no known continuation, so no
#: replay); bench has no draft model to load
GENERATE_DRAFTERS = tuple(d for d in DRAFTERS if d != "replay")
BENCH_DRAFTERS = tuple(d for d in DRAFTERS if d != "draft")
SERVE_DRAFTERS = tuple(d for d in DRAFTERS if d not in ("draft", "replay"))


class UsageError(Exception):
    """A problem with the command's arguments or inputs: printed as one line, exit code 2."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default after its help, unless the default is None or False (nothing
    to show) or the help already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action)


def _prompt_options(p: argparse.ArgumentParser, required: bool, what: str) -> None:
    src = p.add_mutually_exclusive_group(required=required)
    src.add_argument("--prompt", help=f"{what}; '-' reads it from stdin")
    src.add_argument("--prompt-file", help="read the prompt from this UTF-8 text file ('-': "
                                           "stdin)")


def _read_prompt(args) -> str | None:
    """The prompt of ``--prompt`` or ``--prompt-file`` (stdin for '-'), checked to be UTF-8."""
    source = args.prompt_file if args.prompt_file is not None else (
        "-" if args.prompt == "-" else None)
    if source is None:
        text = args.prompt
        if text is not None:
            bad = next((c for c in text if "\udc80" <= c <= "\udcff"), None)
            if bad is not None:             # an undecodable byte of the command line
                raise UsageError(f"--prompt is not UTF-8 text (byte 0x{ord(bad) - 0xdc00:02x} at "
                                 f"character {text.index(bad)}); pass the text in UTF-8, or "
                                 "--prompt-file with a UTF-8 file")
        return text
    where = "stdin" if source == "-" else source
    try:
        raw = sys.stdin.buffer.read() if source == "-" else Path(source).read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read the prompt from {where}: {exc.strerror or exc}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"the prompt in {where} is not UTF-8 text (byte 0x{raw[exc.start]:02x} "
                         f"at offset {exc.start}); convert it, e.g. iconv -t UTF-8") from None


def _acceptance_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--acceptance", default=None,
                   help="the replay drafter's acceptance profile: bundled, qwen3-next-mtp or a "
                        "JSON file (bole/speculative/replay.py)")


def _tp_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks: one process each (gloo on the CPU, NCCL on GPUs, "
                        "one GPU per rank), heads and MLP columns split among them")


def _model_source(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint folder (default: the bundled model)")
    src.add_argument("--preset", help="random weights of a preset (e.g. qwen3.5-9b, tiny)")


def _load_model(args, device: str, dtype, mtp: bool = False):
    """``(model, name, folder or None)`` of ``--model`` / ``--preset`` (a preset's random
    weights get an MTP head when ``mtp``)."""
    from bole.models.presets import PRESETS, preset_config
    from bole.models.qwen3_hybrid import HybridModel
    if args.preset:
        if args.preset.lower() not in PRESETS:
            raise UsageError(f"unknown preset {args.preset!r}; known: {', '.join(PRESETS)}")
        model = HybridModel.random(preset_config(args.preset), dtype=dtype, device=device,
                                   mtp=mtp, tp=getattr(args, "tp_group", None))
        return model, f"{args.preset}-random", None
    folder = _checkpoint(args.model or str(BUNDLED_MODEL), need_tokenizer=False)
    model = HybridModel.from_pretrained(folder, dtype=dtype, device=device,
                                        tp=getattr(args, "tp_group", None))
    name = "bundled" if folder.resolve() == BUNDLED_MODEL.resolve() else folder.name
    return model, name, folder


def _tree_options(p: argparse.ArgumentParser, budget_eps: bool = True) -> None:
    depth, topk, budget = DEFAULT_TREE
    p.add_argument("--depth", type=int, default=depth, help=f"draft tree depth (1-{MAX_DEPTH})")
    p.add_argument("--topk", type=int, default=topk,
                   help=f"children per expanded node (1-{MAX_TOPK})")
    p.add_argument("--budget", type=int, default=budget,
                   help=f"draft-tree nodes per request, root included (2-{MAX_BUDGET})")
    p.add_argument("--budget-policy", default="fixed",
                   choices=["fixed", "global", "calibrated", "goodput"],
                   help="which drafted nodes a verify takes: every request its tree (fixed), the "
                        "batch's best --shared-budget draft nodes (global), the budget of this "
                        "GPU's calibration profile (calibrated; bole calibrate), or the budget "
                        "with the most expected tokens per ms, plain decoding while drafting "
                        "delivers less than it (goodput; not with --tp)")
    p.add_argument("--shared-budget", type=int, default=0,
                   help="draft nodes verified per round across the batch (global policy)")
    p.add_argument("--root-floor", type=int, default=1,
                   help="root children each request keeps whatever the budget")
    if budget_eps:
        p.add_argument("--budget-eps", type=float, default=None,
                       help="the calibrated policy's tolerance: B_ver = the most nodes with "
                            "T_ver <= (1 + eps) T_dec, from the profile's measured curves "
                            "(default: the eps of bole calibrate)")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="the MTP head drafts over this many most frequent tokens (the "
                        "checkpoint's token_counts.json; random weights: the first ids), as "
                        "EAGLE-3 does; 0 = the whole vocabulary. Verification always uses the "
                        "whole vocabulary")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")


def _build_parser() -> argparse.ArgumentParser:
    fmt = HelpFormatter
    parser = argparse.ArgumentParser(prog="bole", description="Exact tree speculative decoding "
                                     "for hybrid-attention (Gated DeltaNet) LLMs.",
                                     formatter_class=fmt)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", formatter_class=fmt,
                          help="the bundled model writes code with tree speculation (statistics "
                          "against plain decoding), then random draft trees are verified exactly "
                          "on one GDN layer of a real model's shape")
    demo.add_argument("--shape", default="qwen3.5-9b", choices=sorted(GDN_SHAPES),
                      help="model whose GDN layer shape to use")
    demo.add_argument("--nodes", type=int, nargs="+", default=[64, 128], help="tree sizes to verify")
    demo.add_argument("--depth", type=int, default=8,
                      help="maximum depth of the random trees of the GDN-layer part")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random trees")
    demo.add_argument("--model", default=str(BUNDLED_MODEL),
                      help="checkpoint folder for the generation part")
    _prompt_options(demo, required=False, what="prompt of the generation part (default: a "
                                               "bundled Python prompt)")
    demo.add_argument("--max-tokens", type=int, default=96, help="tokens to generate")
    demo.add_argument("--no-generate", action="store_true", help="only the GDN-layer part")
    gen = sub.add_parser("generate", formatter_class=fmt,
                         help="generate text from a checkpoint folder; the text goes to stdout, "
                         "statistics to stderr")
    gen.add_argument("--model", default=str(BUNDLED_MODEL),
                     help="checkpoint folder (config.json, safetensors, tokenizer.json)")
    _prompt_options(gen, required=True, what="the prompt text")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    gen.add_argument("--mode", default="bole", choices=list(MODES), help="verification mode")
    gen.add_argument("--drafter", default=None, choices=list(GENERATE_DRAFTERS),
                     help="draft source (default: the checkpoint's MTP head when it has one, "
                          "else n-gram lookup; 'draft' needs --draft-model)")
    gen.add_argument("--draft-model", default=None,
                     help="checkpoint folder of a separate draft model (same tokenizer)")
    _tree_options(gen)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k best tokens (0 = off)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--stop-token-id", action="append", type=int, default=[],
                     help="token id that ends the output (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="do not stop at the checkpoint's end-of-sequence tokens")
    gen.add_argument("--presence-penalty", type=float, default=0.0,
                     help="OpenAI's presence penalty over the generated tokens, in [-2, 2]")
    gen.add_argument("--frequency-penalty", type=float, default=0.0,
                     help="OpenAI's frequency penalty over the generated tokens, in [-2, 2]")
    gen.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="repetition penalty over the prompt and generated tokens (1 = off)")
    gen.add_argument("--logprobs", type=int, default=None,
                     help="with --json: each token's logprob and this many (0-20) alternatives")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--truncate-prompt", action="store_true",
                     help="keep the prompt's last tokens when it is longer than the model's "
                          "context, instead of refusing it")
    _tp_option(gen)
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (text, token ids, statistics) instead of the text")
    bench = sub.add_parser("bench", formatter_class=fmt,
                           help="the same prompts through every mode side by side; JSON and a "
                                "plot under --out")
    _model_source(bench)
    bench.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                       help="modes to run")
    bench.add_argument("--drafter", default=None, choices=list(BENCH_DRAFTERS),
                       help="default: the checkpoint's MTP head when it has one, else n-gram "
                            "lookup; replay: a preset's random MTP head with the proposals of "
                            "--acceptance (plain decoding runs first to know the continuation)")
    _acceptance_option(bench)
    bench.add_argument("--forced-acceptance", action="store_true",
                       help="replay only: greedy acceptance takes the known continuation as the "
                            "target's choice (random bf16 weights flip near-tied argmaxes between "
                            "a decode and a tree verify, which collapses the replay's acceptance)")
    bench.add_argument("--prompt-set", default=None, choices=["code", "repetitive"],
                       help="code: the bundled Python prompts (needs the checkpoint's tokenizer; "
                            "default then); repetitive: repeated random phrases (default for presets)")
    bench.add_argument("--prompts", type=int, default=4, help="number of prompts")
    bench.add_argument("--batches", type=int, nargs="+", default=None,
                       help="batch sizes to run (prompts cycled to fill a batch; default: one "
                            "batch of all prompts)")
    bench.add_argument("--prompt-len", type=int, default=64, help="length of repetitive prompts")
    bench.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"],
                       help="default: bf16 on a GPU, fp32 on the CPU")
    bench.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    _tree_options(bench)
    bench.add_argument("--no-graphs", action="store_true", help="run rounds eagerly on the GPU")
    _tp_option(bench)
    bench.add_argument("--out", default="bench/results",
                       help="folder for the JSON and the plot, relative to where bole runs")
    bench.add_argument("--tag", default="", help="suffix of the result files' names "
                                                  "(default: the time of day)")
    serve = sub.add_parser("serve", formatter_class=fmt,
                           help="an OpenAI-compatible HTTP server with continuous batching")
    serve.add_argument("--model", default=str(BUNDLED_MODEL), help="checkpoint folder")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (loopback by default)")
    serve.add_argument("--port", type=int, default=8000, help="port to bind")
    serve.add_argument("--mode", default="bole", choices=list(MODES), help="verification mode")
    serve.add_argument("--drafter", default=None, choices=list(SERVE_DRAFTERS),
                       help="default: the checkpoint's MTP head when it has one, else n-gram")
    _tree_options(serve)
    serve.add_argument("--max-batch", type=int, default=16,
                       help="requests decoded together (cache slots)")
    serve.add_argument("--max-queue", type=int, default=256,
                       help="requests waiting for a slot before new ones get 503")
    serve.add_argument("--max-len", type=int, default=4096,
                       help="tokens per request (prompt + output + a round's tree), at most the "
                            "model's context")
    serve.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"],
                       help="default: bf16 on a GPU, fp32 on the CPU")
    serve.add_argument("--name", default=None, help="served model name (default: the folder's)")
    serve.add_argument("--engine-process", action="store_true",
                       help="run the engine in a process of its own (the HTTP process then "
                            "never holds up a round; not with --tp)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but /health and "
                            "/metrics (default: the BOLE_API_KEY environment variable; none: "
                            "open)")
    serve.add_argument("--max-prompt-bytes", type=int, default=None,
                       help="refuse prompts longer than this many UTF-8 bytes before tokenizing "
                            "them (default: 1 MiB or 32 bytes per token of --max-len, the more)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds SIGTERM lets in-flight requests finish (new ones get 503) "
                            "before the rest end with finish_reason 'abort'")
    serve.add_argument("--access-log", action="store_true",
                       help="log every HTTP request (off: the log lines cost the event loop "
                            "time that the engine's thread waits for under load)")
    _tp_option(serve)
    cal = sub.add_parser("calibrate", formatter_class=fmt,
                         help="measure how many tree nodes a verify forward takes before it costs "
                              "more than decoding, per batch (the calibrated and goodput budgets' "
                              "profile, one per tree size: pass the --depth, --topk and --budget "
                              "the engine will run)")
    _model_source(cal)
    cal.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64],
                     help="batch sizes to measure")
    cal.add_argument("--eps", type=float, default=0.1,
                     help="B_ver(b) = the most nodes with T_ver <= (1 + eps) T_dec")
    cal.add_argument("--context", type=int, default=1024, help="committed tokens per request")
    cal.add_argument("--reps", type=int, default=10, help="timed repetitions per point")
    _tree_options(cal, budget_eps=False)
    try:
        from bole.server.loadgen import add_parser as add_loadgen
        add_loadgen(sub)
    except ImportError:                          # the server's optional dependencies are absent
        pass
    return parser


# ---- checks that need nothing loaded ----
def _device(name: str | None) -> str:
    import torch
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UsageError(f"unknown device {name!r}; use cpu or cuda") from None
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"device {name!r} is not supported; use cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for a GPU, but this PyTorch sees none (no CUDA "
                         "build or no device); use --device cpu")
    return name


def _checkpoint(folder: str, need_tokenizer: bool) -> Path:
    path = Path(folder)
    if not path.exists():
        raise UsageError(f"the model folder {folder} does not exist; give a checkpoint folder "
                         "or leave --model out for the bundled model")
    if not path.is_dir():
        raise UsageError(f"--model {folder} is a file; give the checkpoint's folder")
    missing = [n for n in ("config.json",) + (("tokenizer.json",) if need_tokenizer else ())
               if not (path / n).is_file()]
    if missing:
        raise UsageError(f"{folder} is not a checkpoint folder: {', '.join(missing)} missing "
                         "(a Qwen3.5 / Qwen3-Next folder has config.json, *.safetensors and "
                         "tokenizer.json)")
    return path


def _tokenizer(folder: Path):
    from tokenizers import Tokenizer
    file = folder / "tokenizer.json"
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:                     # tokenizers raises a bare Exception
        raise UsageError(f"{file} is not a readable tokenizer ({exc}); replace it with the "
                         "checkpoint's tokenizer.json") from None


def _spec(args, drafter: str):
    from bole.engine import SpecConfig
    spec = SpecConfig(args.mode if hasattr(args, "mode") else "bole", drafter, args.depth,
                      args.topk, args.budget, getattr(args, "acceptance", None),
                      getattr(args, "budget_policy", "fixed"), getattr(args, "shared_budget", 0),
                      getattr(args, "root_floor", 1), getattr(args, "draft_vocab", 0),
                      budget_eps=getattr(args, "budget_eps", None))
    try:
        spec.validate()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return spec


def _positive(**values) -> None:
    for name, v in values.items():
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")


# ---- commands ----
def _bench(args) -> int:
    import torch

    from bole.assets import code_prompts
    from bole.benchmark import repetitive_prompts, run_modes, write_results
    from bole.engine import default_drafter

    _positive(prompts=args.prompts, max_tokens=args.max_tokens, prompt_len=args.prompt_len)
    for b in args.batches or ():
        _positive(batches=b)
    device = _device(args.device)
    args.mode = "bole"
    spec = _spec(args, args.drafter or "ngram")
    if args.forced_acceptance and spec.drafter != "replay":
        raise UsageError("--forced-acceptance replays a known continuation: it needs "
                         "--drafter replay")
    if spec.drafter == "replay":
        from bole.speculative.replay import AcceptanceProfile
        try:
            AcceptanceProfile.load(args.acceptance or "")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(
        args.dtype, torch.bfloat16 if device.startswith("cuda") else torch.float32)
    tokenizer = None
    model, name, folder = _load_model(args, device, dtype, mtp=args.drafter in ("mtp", "replay"))
    if folder is not None:
        if (folder / "tokenizer.json").is_file():
            tokenizer = _tokenizer(folder)
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


def _generate(args) -> int:
    import json
    import time

    import torch

    from bole.engine import Engine, GenerationParams, default_drafter
    from bole.models.qwen3_hybrid import HybridModel
    from bole.speculative.sampling import SamplingParams

    _positive(max_tokens=args.max_tokens)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.presence_penalty,
                              args.frequency_penalty, args.repetition_penalty)
    try:
        sampling.validate()
        GenerationParams(logprobs=args.logprobs).validate()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    device = _device(args.device)
    folder = _checkpoint(args.model, need_tokenizer=True)
    if args.draft_model:
        _checkpoint(args.draft_model, need_tokenizer=False)
    _spec(args, args.drafter or "ngram")
    tokenizer = _tokenizer(folder)
    from bole.models.config import HybridConfig
    context = HybridConfig.from_pretrained(folder).max_position_embeddings
    room = context - args.max_tokens - args.depth - 2
    if room < 1:
        raise UsageError(f"--max-tokens {args.max_tokens} leaves no room for a prompt in the "
                         f"model's context of {context} tokens; pass --max-tokens "
                         f"{context - args.depth - 3} or less")
    ids = tokenizer.encode(_read_prompt(args)).ids
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
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = HybridModel.from_pretrained(folder, dtype=dtype, device=device,
                                        tp=getattr(args, "tp_group", None))
    draft_model = (HybridModel.from_pretrained(args.draft_model, dtype=dtype, device=device)
                   if args.draft_model else None)
    drafter = args.drafter or ("draft" if draft_model is not None else default_drafter(model))
    spec = _spec(args, drafter)
    eos = () if args.ignore_eos else tuple(model.config.eos_token_id)
    params = GenerationParams(max_tokens=args.max_tokens,
                              stop_token_ids=eos + tuple(args.stop_token_id),
                              stop_strings=tuple(args.stop), sampling=sampling,
                              logprobs=args.logprobs)
    engine = Engine(model, spec, max_slots=1, tokenizer=tokenizer, draft_model=draft_model,
                    max_len=len(ids) + args.max_tokens + max(spec.nodes_per_request,
                                                             args.depth + 1) + 1)
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


def _demo(args) -> int:
    from bole import demo, generation_demo
    if any(n < 1 for n in args.nodes) or args.depth < 0 or args.max_tokens < 1:
        raise UsageError("--nodes and --max-tokens must be >= 1 and --depth >= 0")
    if not args.no_generate:
        folder = _checkpoint(args.model, need_tokenizer=True)
        _tokenizer(folder)
        generation_demo.run(folder, _read_prompt(args), args.max_tokens)
    demo.main(args.shape, tuple(args.nodes), args.depth, args.seed)
    return 0


def _set_rank_device(args, rank: int) -> None:
    """A tensor-parallel rank's device: its own GPU (``cuda:rank``) or the CPU."""
    if _device(args.device).startswith("cuda"):
        args.device = f"cuda:{rank}"


def _calibrate(args) -> int:
    import torch

    from bole.engine.calibrate import calibrate_model
    from bole.speculative.budget import spread_width

    for b in args.batches:
        _positive(batches=b)
    _positive(context=args.context, reps=args.reps)
    if args.eps < 0:
        raise UsageError(f"--eps must be >= 0, got {args.eps}")
    device = _device(args.device)
    args.mode = "bole"
    spec = _spec(args, "ngram")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model, _, _ = _load_model(args, device, dtype)
    profile = calibrate_model(model, spec, args.batches, eps=args.eps, context=args.context,
                              reps=args.reps)
    print(f"{'batch':>6} {'T_dec ms':>9} {'B_ver':>6} {'width':>6}")
    for b, t, n in zip(profile.batches, profile.t_dec, profile.b_ver):
        width = spread_width(b, n, profile.tree_nodes) if n else "-"
        print(f"{b:>6} {t:>9.3f} {n:>6} {width:>6}")
    print(f"wrote {profile.path()}")
    return 0


def _tp_worker(rank: int, world: int, port: int, argv: list[str]) -> None:
    """One tensor-parallel rank of a command: rank 0 prints, the others stay silent."""
    from bole import distributed
    args = _build_parser().parse_args(argv)
    _set_rank_device(args, rank)
    args.tp_group = distributed.init(rank, world, port, args.device or "cpu")
    try:
        with distributed.quiet_unless_rank0(rank):
            rc = {"generate": _generate, "bench": _bench}[args.command](args)
    finally:
        distributed.shutdown(meet=True)
    if rc:
        raise SystemExit(rc)


def _run_tp(args, argv: list[str]) -> int:
    """Spawn ``--tp`` ranks of this command (one process each) and wait for them."""
    import torch
    import torch.multiprocessing as mp

    from bole.distributed import free_port
    if args.tp < 1:
        raise UsageError(f"--tp must be >= 1, got {args.tp}")
    device = _device(args.device)
    if device.startswith("cuda") and torch.cuda.device_count() < args.tp:
        raise UsageError(f"--tp {args.tp} needs {args.tp} GPUs, this machine has "
                         f"{torch.cuda.device_count()}")
    from bole.models.config import HybridConfig
    from bole.models.sharding import check_divisible
    if getattr(args, "preset", None):
        from bole.models.presets import preset_config
        check_divisible(preset_config(args.preset), args.tp)
    else:
        check_divisible(HybridConfig.from_pretrained(_checkpoint(
            args.model or str(BUNDLED_MODEL), need_tokenizer=False)), args.tp)
    if args.command == "serve":
        if args.engine_process:
            raise UsageError("--engine-process runs one engine process: not with --tp")
        from bole.cli_serve import serve_tp
        return serve_tp(args, argv)
    mp.spawn(_tp_worker, args=(args.tp, free_port(), argv), nprocs=args.tp, join=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _build_parser().parse_args(argv)
    if getattr(args, "tp", 1) != 1:
        try:
            return _run_tp(args, argv)
        except (UsageError, ValueError, FileNotFoundError) as exc:
            print(f"bole {args.command}: {exc}", file=sys.stderr)
            return 2
    from bole.cli_serve import serve
    commands = {"demo": _demo, "generate": _generate, "bench": _bench, "serve": serve,
                "calibrate": _calibrate}
    if args.command == "bench-serve":
        from bole.server.loadgen import main as bench_serve
        return bench_serve(args)
    command = commands[args.command]
    try:
        return command(args)
    except (UsageError, ValueError, FileNotFoundError) as exc:
        print(f"bole {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
