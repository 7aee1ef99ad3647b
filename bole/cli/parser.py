"""The ``bole`` argument parser: one sub-parser per command, options shared among them."""

from __future__ import annotations

import argparse

from bole.assets import BUNDLED_MODEL
from bole.cli.common import HelpFormatter
from bole.config import GDN_SHAPES
from bole.engine.spec import DEFAULT_TREE, MAX_BUDGET, MAX_DEPTH, MAX_TOPK, MODES
from bole.speculative.budget.registry import DEFAULT_POLICY, POLICIES
from bole.speculative.drafters.registry import drafter_names


#: drafters by command: generate and serve draft for real requests (no known continuation, so no
#: replay); bench has no draft model to load
GENERATE_DRAFTERS = drafter_names(replays=False)
BENCH_DRAFTERS = drafter_names(draft_model=False)
SERVE_DRAFTERS = drafter_names(replays=False, draft_model=False)


def _prompt_options(p: argparse.ArgumentParser, required: bool, what: str) -> None:
    src = p.add_mutually_exclusive_group(required=required)
    src.add_argument("--prompt", help=f"{what}; '-' reads it from stdin")
    src.add_argument("--prompt-file", help="read the prompt from this UTF-8 text file ('-': "
                                           "stdin)")


def _acceptance_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--acceptance", default=None,
                   help="the replay drafter's acceptance profile: bundled, qwen3-next-mtp or a "
                        "JSON file (bole/speculative/drafters/replay.py)")


def _tp_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks: one process each (gloo on the CPU, NCCL on GPUs, "
                        "one GPU per rank), heads and MLP columns split among them")


def _prefix_cache_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="do not keep the state of committed prompt prefixes for later requests "
                        "(on by default; off with --tp)")
    p.add_argument("--prefix-cache-gib", type=float, default=None,
                   help="device memory the prefix cache may hold (default: a tenth of the "
                        "GPU's, at most 16 GiB; 1 GiB on the CPU)")


def _model_source(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint folder (default: the bundled model)")
    src.add_argument("--preset", help="random weights of a preset (e.g. qwen3.5-9b, tiny)")


def _tree_options(p: argparse.ArgumentParser, budget_eps: bool = True) -> None:
    depth, topk, budget = DEFAULT_TREE
    p.add_argument("--depth", type=int, default=depth, help=f"draft tree depth (1-{MAX_DEPTH})")
    p.add_argument("--topk", type=int, default=topk,
                   help=f"children per expanded node (1-{MAX_TOPK})")
    p.add_argument("--budget", type=int, default=budget,
                   help=f"draft-tree nodes per request, root included (2-{MAX_BUDGET})")
    p.add_argument("--budget-policy", default=DEFAULT_POLICY, choices=list(POLICIES),
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


def _add_demo(sub, fmt) -> None:
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


def _add_generate(sub, fmt) -> None:
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
    _prefix_cache_options(gen)
    _tp_option(gen)
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (text, token ids, statistics) instead of the text")


def _add_bench(sub, fmt) -> None:
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


def _add_serve(sub, fmt) -> None:
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
    _prefix_cache_options(serve)
    _tp_option(serve)
    _replica_options(serve)


def _replica_options(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--replicas", type=int, default=None,
                       help="run N engines as Ray Serve replicas behind Ray Serve's HTTP proxy "
                            "(a GPU per --tp rank each on CUDA; needs: pip install \"bole[ray]\"); "
                            "docs/multi-node.md")
    serve.add_argument("--replica-cpus", type=int, default=None,
                       help="with --replicas on the CPU: cores (torch threads) per replica "
                            "(default: this machine's cores / N)")
    serve.add_argument("--ray-address", default=None,
                       help="with --replicas: the Ray cluster to deploy on ('auto': the one "
                            "'ray start' began here; default: a Ray instance of its own)")


def _add_calibrate(sub, fmt) -> None:
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


def add_bench_serve(sub, fmt=HelpFormatter) -> None:
    """Register ``bench-serve``: an option per LoadConfig field, and inputs and outputs."""
    from dataclasses import fields

    from bole.bench.loadgen import LoadConfig
    p = sub.add_parser(
        "bench-serve", formatter_class=fmt,
        help="load a running OpenAI-compatible server with streaming completions: TTFT, TPOT, "
             "ITL, tokens/s and goodput; JSON and a plot under --out")
    for f in fields(LoadConfig):                    # f.type is a string such as "int | None"
        kind = {"int": int, "float": float}.get(f.type.split(" ")[0], str)
        p.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default,
                       help=f.metadata["help"])
    p.add_argument("--prompts", help='JSONL file, one {"prompt": ..., "max_tokens": ... '
                   "(optional)} a line, cycled; None: the bundled code prompts")
    p.add_argument("--tokenizer", help="tokenizer.json or its folder, to count a delta's tokens "
                   "when the server's chunks carry no counts; None: a delta counts as one")
    p.add_argument("--out", default="bench/results", help="folder of the JSON and the plot")
    p.add_argument("--tag", default="", help="mode in the file names if the server reports none")


def build_parser() -> argparse.ArgumentParser:
    """The parser of every ``bole`` command."""
    fmt = HelpFormatter
    parser = argparse.ArgumentParser(prog="bole", description="Exact tree speculative decoding "
                                     "for hybrid-attention (Gated DeltaNet) LLMs.",
                                     formatter_class=fmt)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_demo, _add_generate, _add_bench, _add_serve, _add_calibrate):
        add(sub, fmt)
    try:
        add_bench_serve(sub, fmt)
    except ImportError:                          # the server's optional dependencies are absent
        pass
    return parser
