"""End-to-end study at real shapes: every mode at batch 1-64, tokens/s, the round's split,
accepted tokens, memory and the largest batch that fits.

Random-weight presets (Qwen3.5-9B / 27B, bf16, a random one-layer MTP head) draft with the
replay drafter: the head runs at its true size, its proposals follow an acceptance profile
(``--profile``, default qwen3-next-mtp, fitted to published accept lengths; every table says so),
and the target verifies every token for real, so output equals plain decoding's. The bundled
model drafts with its own MTP head (real acceptance). Per model and batch:

    ar            plain decoding (its output is the replay drafter's known continuation)
    chain         one path of d drafts, snapshot per position; d swept (--chain-depths), best kept
    tree-serial   the bole trees, node-by-node GDN with snapshots, copy commit
    bole          closed form + factors; (depth, topk, budget) swept (--tree-shapes), best kept
    bole-POLICY   bole under a verification-budget policy (--budget-policies: global,
                  calibrated, goodput) on the largest swept tree, or with --policy-tree best
                  on bole's best one

tree-serial runs bole's best shape, so the two see the same trees (``--tune-tree-serial``: its
own best of --tree-shapes instead, as a sweep of its own). The best of a sweep is run
once more and that run is reported (``sweep_best_decode_tokens_per_s`` keeps the sweep's figure):
the best of several runs is also the luckiest. Memory: peak device memory
per run, and the largest batch that fits 80% of the device at --max-context tokens per request
(weights + per-slot cache + the round's transient state: factors for bole, a snapshot per node
for tree-serial, per position for chain); ``--confirm-max-batch`` runs tree-serial's limit for
a few rounds to check it, and 80% of the last batch tried while it does not fit (at most three
times more; ``max_batch_confirmed`` in the JSON: every run and the largest that ran).

    python bench/e2e.py                           # on a GPU -> bench/results/e2e-<date>.{json,png}
    python bench/e2e.py --models tiny --batches 1 2 --device cpu --max-tokens 16   # smoke run
    python bench/e2e.py --tp 2 ...                # tensor parallel: one process per rank

With ``--tp N`` every rank runs the same study on its shard (gloo on the CPU, NCCL on GPUs, one
GPU per rank; the ``bole --tp`` layout); rank 0's choice of the best shapes is broadcast so the
ranks run the same configurations, and rank 0 alone prints and writes. Records carry ``tp`` and
an ``output_digest`` of the generated tokens, to compare runs token for token.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import hashlib
import json
import sys
import textwrap
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# Run by path, Python puts bench/ first on sys.path: drop it, so that bench's modules are reached
# as bench.<name> and can never shadow, or be shadowed by, an installed package of the same name.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench")]

from bole import distributed  # noqa: E402
from bole.assets import BUNDLED_MODEL, code_prompts  # noqa: E402
from bole.engine import Engine, SamplingParams, SpecConfig  # noqa: E402
from bole.engine.calibrate import load_or_calibrate  # noqa: E402
from bole.models.config import HybridConfig  # noqa: E402
from bole.models.presets import preset_config  # noqa: E402
from bole.models.qwen3_hybrid import HybridModel  # noqa: E402
from bole.speculative.budget.registry import policy_info  # noqa: E402
from bole.speculative.drafters.registry import drafter_info  # noqa: E402
from bench.harness import save_png, source_commit, versions  # noqa: E402


def load(name: str, device: str, dtype: torch.dtype, tp=None):
    """(model, prompts as token ids, drafter, profile) of a study model (this rank's shard
    under tensor parallelism, ``tp``)."""
    if name == "bundled":
        from tokenizers import Tokenizer
        model = HybridModel.from_pretrained(BUNDLED_MODEL, dtype=dtype, device=device, tp=tp)
        tok = Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
        return model, [tok.encode(p).ids for p in code_prompts()], "mtp", None
    model = HybridModel.random(preset_config(name), dtype=dtype, device=device, mtp=True, tp=tp)
    return model, None, "replay", None


def config_of(name: str) -> HybridConfig:
    return HybridConfig.from_pretrained(BUNDLED_MODEL) if name == "bundled" else \
        preset_config(name)


def digest(outputs: list[list[int]]) -> str:
    """A short hash of every request's tokens: equal digests, equal outputs."""
    return hashlib.sha1(json.dumps(outputs).encode()).hexdigest()[:12]


def prompts_for(model, given, batch: int, context: int, seed: int) -> list[list[int]]:
    if given is not None:
        return [given[i % len(given)] for i in range(batch)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.config.vocab_size, (context,), generator=gen).tolist()
            for _ in range(batch)]


def requests_per_run(args, batch: int) -> int:
    """Requests a run of ``batch`` slots submits: whole waves of ``batch``, enough that they
    generate at least --min-run-tokens in all (acceptance is then averaged over about as many
    request rounds at every batch: a lone 128-token request is about 22 rounds)."""
    return batch * max(1, -(-args.min_run_tokens // (batch * args.max_tokens)))


def run(model, spec: SpecConfig, prompts, max_tokens: int, continuations, device,
        slots: int | None = None, budget_profile=None, warmup_requests: int = 0) -> dict:
    """One timed generate of ``prompts`` (after a warm-up) with its round split and peak memory:
    ``slots`` requests at a time (default all), each finished one's slot taking the next
    (continuous batching). ``budget_profile``: the calibrated and goodput policies' profile
    (default: this device's saved one). The warm-up generates 8 tokens for the first
    ``warmup_requests`` prompts (0: one per slot; the rounds' graphs are captured whatever it
    runs, so fewer saves their prefills at large batches)."""
    slots = slots or len(prompts)
    scratch = max(spec.nodes_per_request, spec.depth + 1)
    max_len = max(map(len, prompts)) + max_tokens + scratch + 1
    _free(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        return _timed(model, spec, prompts, max_tokens, continuations, device, slots, max_len,
                      budget_profile, warmup_requests or slots)
    except RuntimeError as exc:          # torch.OutOfMemoryError is one; so are cuBLAS's
        # under tensor parallelism a rank that went on alone would leave the others waiting in
        # a collective: there it ends the run
        if not _out_of_memory(exc) or (model is not None and model.tp.world > 1):
            raise
        print(f"[e2e] {spec.mode} {spec.depth},{spec.topk},{spec.budget} at batch {slots} does "
              f"not fit: {str(exc).splitlines()[0]}", file=sys.stderr, flush=True)
        return does_not_fit(exc, device)
    finally:
        _free(device)


def does_not_fit(exc: BaseException | str, device: str | None) -> dict:
    """The record of a run that ran out of device memory (or, ``exc`` a string, was not run
    for that reason): no figures, the error's first line and the peak it reached."""
    return dict(fits=False, error=str(exc).splitlines()[0], tokens_per_s=None,
                decode_tokens_per_s=None,
                peak_mem_gib=(torch.cuda.max_memory_allocated() / 2 ** 30
                              if device == "cuda" else None))


def _free(device: str) -> None:
    """Collect the last engine (its graphs and buffers hold each other) and hand its memory
    back, so that the next run starts from the model alone."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _timed(model, spec: SpecConfig, prompts, max_tokens: int, continuations, device,
           slots: int, max_len: int, budget_profile, warmup: int) -> dict:
    engine = Engine(model, spec, max_slots=slots, max_len=max_len, budget_profile=budget_profile)
    warmup = min(warmup, slots)
    warm = SamplingParams(max_tokens=min(8, max_tokens), ignore_eos=True)
    engine.generate(prompts[:warmup], warm, seed=0,
                    continuations=continuations and continuations[:warmup])
    engine.timings = type(engine.timings)()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                          seed=0, continuations=continuations)
    elapsed = time.perf_counter() - t0
    split = engine.timings.summary()
    tokens = sum(len(r.token_ids) for r in res)
    rounds = sum(r.rounds for r in res)
    accepted = sum(sum(r.accepted) for r in res)
    rows = sum(n * row[0] for n, row in engine.timings.by_batch.items())   # request rounds
    nodes = rows * spec.nodes_per_request
    outputs = [r.token_ids for r in res]
    decode_rate, prefill_s = engine.timings.decode_split(tokens - len(prompts), elapsed)
    full_rate, full_rounds = engine.timings.full_batch_rate() or (None, 0)
    out = dict(fits=True, tokens_per_s=tokens / elapsed,
               decode_tokens_per_s=decode_rate, prefill_s=prefill_s,
               full_batch_tokens_per_s=full_rate, full_batch_rounds=full_rounds,
               mean_accepted_tokens=accepted / max(1, rounds),
               tokens_per_verified_node=accepted / max(1, nodes), round_ms=split["round_ms"],
               batch_rounds=engine.timings.rounds,
               draft_ms=split["draft_ms"], verify_ms=split["verify_ms"],
               accept_commit_ms=split["accept_commit_ms"], host_ms=split["host_ms"],
               plain_round_share=split["plain_round_share"],
               draft_nodes_per_round=split["draft_nodes_per_round"],
               eager_fallbacks=engine.rounds.graphs.stats["eager_fallbacks"],
               rounds_by_draft_nodes=sorted([kind, n, count] for (kind, n), count
                                            in engine.timings.by_nodes.items()),
               rounds_by_draft_depth=sorted([d, count] for d, count
                                            in engine.timings.by_depth.items()),
               acceptance_estimates=acceptance_estimates(engine),
               peak_mem_gib=(torch.cuda.max_memory_allocated() / 2 ** 30
                             if device == "cuda" else None),
               outputs=outputs, output_digest=digest(outputs))
    return out


def acceptance_estimates(engine) -> dict | None:
    """Goodput's learnt acceptance after a run: per rho bin its lower edge, the draft nodes
    seen, the accepted share and the fitted estimate (None for the other policies)."""
    cal = engine.rounds.calibrator
    if cal is None:
        return None
    seen = cal.count.tolist()
    return dict(rho_from=cal.edges[:-1].tolist(), seen=seen,
                accepted=[h / c if c else None for h, c in zip(cal.hits.tolist(), seen)],
                estimate=cal.table.tolist())


def transient_bytes(model, spec: SpecConfig) -> int:
    """A request's speculative state during one round: per-node GDN snapshots (tree-serial,
    chain) or factors (bole), over every GDN layer."""
    c = model.config
    T = spec.nodes_per_request
    layers, Hv, dk, dv = (len(c.gdn_layers), c.linear_num_value_heads, c.linear_key_head_dim,
                          c.linear_value_head_dim)
    if spec.mode in ("tree-serial", "chain"):
        return layers * T * Hv * dk * dv * 4
    if spec.mode == "bole":
        return layers * T * (Hv * (dv * 4 + 8) + c.linear_num_key_heads * (dk * 2 + 4))
    return 0


def slot_bytes(model, max_len: int) -> int:
    """One request's cache slot: KV rows of every full-attention layer, fp32 GDN states and
    conv states of every GDN layer."""
    c, e = model.config, torch.empty(0, dtype=model.dtype).element_size()
    kv = 2 * len(c.full_attention_layers) * max_len * c.num_key_value_heads * c.head_dim * e
    gdn = len(c.gdn_layers) * c.linear_num_value_heads * c.linear_key_head_dim * \
        c.linear_value_head_dim * 4
    conv = len(c.gdn_layers) * c.conv_dim * (c.linear_conv_kernel_dim - 1) * e
    return kv + gdn + conv


def max_batch(model, spec: SpecConfig, context: int, device: str, share: float = 0.8) -> int:
    """The largest batch whose weights, caches and round state fit ``share`` of the device
    (this rank's under tensor parallelism)."""
    if device != "cuda":
        return 0
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory * share
    weights = sum(t.numel() * t.element_size() for t in model.w.values() if t._base is None)
    cache = slot_bytes(model, context + spec.nodes_per_request)
    logits = spec.nodes_per_request * model.config.vocab_size * 4
    per_request = cache + transient_bytes(model, spec) + logits
    return max(0, int((total - weights) // per_request))


def confirm(model, spec: SpecConfig, context: int, batch: int, device: str) -> dict:
    """Run ``batch`` requests of ``context`` prompt tokens for a few rounds of ``spec``: does a
    computed max batch really fit? Returns what happened (``ok``, peak memory, the error)."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (context,), generator=gen).tolist()
    scratch = max(spec.nodes_per_request, spec.depth + 1)
    rec = dict(mode=spec.mode, shape=dict(depth=spec.depth, topk=spec.topk, budget=spec.budget),
               batch=batch, context=context)
    _free(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    engine = None
    t0 = time.perf_counter()
    try:
        engine = Engine(model, spec, max_slots=batch, max_len=context + 4 + scratch + 1)
        res = engine.generate([prompt] * batch, SamplingParams(max_tokens=4, ignore_eos=True),
                              seed=0)
        rec.update(ok=True, tokens=sum(len(r.token_ids) for r in res))
    except RuntimeError as exc:          # torch.OutOfMemoryError is one; so are cuBLAS's
        if not _out_of_memory(exc):
            raise
        rec.update(ok=False, error=str(exc).splitlines()[0])
    rec["seconds"] = time.perf_counter() - t0
    if device == "cuda":
        rec.update(peak_mem_gib=torch.cuda.max_memory_allocated() / 2 ** 30,
                   device_gib=torch.cuda.get_device_properties(
                       torch.cuda.current_device()).total_memory / 2 ** 30)
    del engine
    _free(device)
    return rec


def _out_of_memory(exc: BaseException | None) -> bool:
    """Whether an error is the device running out of memory: torch's own, or a library's
    RuntimeError saying so (cuBLAS, graph instantiation), or an error raised while one was
    being handled (a graph capture ended by it)."""
    if exc is None:
        return False
    text = str(exc).lower()
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text \
        or "alloc_failed" in text or _out_of_memory(exc.__cause__ or exc.__context__)


def confirm_max_batch(model, spec: SpecConfig, context: int, computed: int, device: str,
                      tries: int = 3) -> dict:
    """:func:`confirm` at the computed max batch; when it does not fit, at 80% of the last
    batch tried, up to ``tries`` more times. Returns every run and the largest that ran."""
    runs, n = [confirm(model, spec, context, computed, device)], computed
    while not runs[-1]["ok"] and len(runs) <= tries and n > 1:
        n = max(1, int(n * 0.8))
        runs.append(confirm(model, spec, context, n, device))
    ran = [r["batch"] for r in runs if r["ok"]]
    return dict(mode=spec.mode, computed=computed, context=context, runs=runs,
                largest_run=max(ran, default=None))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen3.5-9b", "qwen3.5-27b", "bundled"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--profile", default="qwen3-next-mtp")
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens (presets)")
    ap.add_argument("--max-context", type=int, default=8192, help="for the max-batch column")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--min-run-tokens", type=int, default=0,
                    help="submit whole waves of --max-tokens requests, BATCH at a time, until "
                         "a run generates at least this many tokens (small batches then average "
                         "acceptance over as many request rounds as large ones)")
    ap.add_argument("--chain-depths", type=int, nargs="+", default=[2, 3, 4, 6])
    ap.add_argument("--tree-shapes", nargs="+", default=["4,2,8", "6,3,16", "8,4,32", "8,4,64"],
                    help="depth,topk,budget of bole's tree, swept per batch")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="the MTP head drafts over this many most frequent tokens (0: all); the "
                         "replay drafter keeps its profile's acceptance")
    ap.add_argument("--tune-tree-serial", action="store_true",
                    help="sweep tree-serial over --tree-shapes and report its own best shape "
                         "(default: bole's best shape, the same trees as bole)")
    ap.add_argument("--unforced", action="store_true",
                    help="replay: accept by the target's argmax (random bf16 weights flip near-tied "
                         "argmaxes between decode and tree verify, which collapses acceptance)")
    ap.add_argument("--confirm-max-batch", action="store_true",
                    help="after each model, run tree-serial's computed max batch at "
                         "--max-context for a few rounds (minutes on a 9B: 8k-token prefills)")
    ap.add_argument("--confirm-batch", type=int, default=0,
                    help="the batch to confirm instead of the computed one (smoke runs)")
    ap.add_argument("--budget-policies", nargs="*", default=[],
                    choices=["global", "calibrated", "goodput"],
                    help="also run bole under these verification-budget policies (mode "
                         "bole-<policy>, on the tree --policy-tree names; the calibration "
                         "profile is made first where missing; tp 1 only)")
    ap.add_argument("--warmup-requests", type=int, default=0,
                    help="requests in each run's warm-up (0: one per slot); the rounds' graphs are "
                         "captured either way, and fewer save the warm-up's prefills at large "
                         "batches (a 27B prefill of 64 x 2k tokens takes about 20 s), but then the "
                         "policies' state at the full batch (goodput's first rounds, the last "
                         "width) is learnt inside the timed run")
    ap.add_argument("--policy-tree", choices=["largest", "best"], default="largest",
                    help="the tree the budget policies choose from: the largest of --tree-shapes, "
                         "or bole's best fixed tree at that batch")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel ranks: one process each (one GPU each on CUDA)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--table", nargs="+", metavar="JSON",
                    help="print the markdown table of these result files (the README's) and "
                         "exit: no run")
    args = ap.parse_args(argv)
    if args.warmup_requests < 0:
        ap.error(f"--warmup-requests must be >= 0 (0: one per slot), got {args.warmup_requests}")
    if args.table:
        print(table([Path(p) for p in args.table]))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: pass --device cpu for a smoke run", file=sys.stderr)
        return 2
    if args.tp == 1:
        study(args)
        return 0
    problem = tp_problem(args)
    if problem:
        print(f"e2e: {problem}", file=sys.stderr)
        return 2
    import torch.multiprocessing as mp
    mp.spawn(rank_main, args=(args, distributed.free_port()), nprocs=args.tp, join=True)
    return 0


def tp_problem(args) -> str | None:
    """Why ``--tp`` cannot run here (None when it can)."""
    if args.tp < 1:
        return f"--tp must be >= 1, got {args.tp}"
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        return f"--tp {args.tp} needs {args.tp} GPUs, this machine has {torch.cuda.device_count()}"
    from bole.models.sharding import check_divisible
    try:
        for name in args.models:
            check_divisible(config_of(name), args.tp)
    except (ValueError, FileNotFoundError) as exc:
        return f"{name}: {exc}"
    return None


def rank_main(rank: int, args, port: int) -> None:
    """One tensor-parallel rank of the study: rank 0 prints and writes, the others are silent."""
    tp = distributed.init(rank, args.tp, port, args.device)
    try:
        with distributed.quiet_unless_rank0(rank):
            study(args, tp)
    finally:
        distributed.shutdown(meet=True)


def study(args, tp=None) -> Path | None:
    """Every model and batch (this rank's part under ``tp``); rank 0 writes the JSON and plot."""
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    device = f"cuda:{tp.rank}" if tp is not None and args.device == "cuda" else args.device
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.tree_shapes]
    records, confirmations, profiles = [], [], {}
    for name in args.models:
        model, given, drafter, _ = load(name, device, dtype, tp)
        replays = drafter_info(drafter).replays_continuation
        profile = args.profile if replays else None
        forced = replays and not args.unforced
        best: dict = {}
        for batch in args.batches:
            requests = requests_per_run(args, batch)
            prompts = prompts_for(model, given, requests, args.context, seed=batch)
            base = dict(model=name, drafter=drafter, profile=profile, batch=batch, tp=args.tp,
                        requests=requests)
            def go(spec: SpecConfig, cont=None, batch=batch, prompts=prompts) -> dict:
                return run(model, spec, prompts, args.max_tokens, cont, args.device, batch,
                           warmup_requests=args.warmup_requests)

            ar = go(SpecConfig("ar"))
            cont = ar.pop("outputs", None)
            records.append(dict(base, mode="ar", shape=None, **ar))
            if not ar["fits"]:               # no continuation to replay, nothing to compare
                if tp is None or not tp.rank:
                    write(args, records, confirmations, profiles)
                continue
            candidates = {"chain": [], "bole": []}
            if args.tune_tree_serial:
                candidates["tree-serial"] = []
            for d in args.chain_depths:
                spec = SpecConfig("chain", drafter, d, 1, d + 1, profile,
                                  draft_vocab=args.draft_vocab, forced_acceptance=forced)
                candidates["chain"].append((spec, go(spec, cont)))
            for d, k, b in shapes:
                for mode in ("bole", "tree-serial"):
                    if mode not in candidates:
                        continue
                    spec = SpecConfig(mode, drafter, d, k, b, profile,
                                      draft_vocab=args.draft_vocab, forced_acceptance=forced)
                    candidates[mode].append((spec, go(spec, cont)))
            best = {}
            for mode, tried in candidates.items():
                spec, res = tried[fastest(tried, model)]
                if res["fits"] and sum(r["fits"] for _, r in tried) > 1:
                    # its figure from a fresh run: the best of several runs is also the
                    # luckiest, and reporting it would hand the mode its timing noise
                    picked = res["decode_tokens_per_s"]
                    res = dict(go(spec, cont), sweep_best_decode_tokens_per_s=picked)
                best[mode] = (spec, res)
            bole_fits = best["bole"][1]["fits"]
            unfit = "not run: no bole tree fits"
            if "tree-serial" not in best:            # on bole's trees
                b_spec = best["bole"][0]
                t_spec = SpecConfig("tree-serial", drafter, b_spec.depth, b_spec.topk,
                                    b_spec.budget, profile, draft_vocab=args.draft_vocab,
                                    forced_acceptance=forced)
                best["tree-serial"] = (t_spec, go(t_spec, cont) if bole_fits else
                                       does_not_fit(unfit, None))
            # the budget policies on the largest tree (the global one keeps half its nodes), or
            # on bole's best fixed one
            tree = (max(shapes, key=lambda sh: sh[2]) if args.policy_tree == "largest" else
                    (best["bole"][0].depth, best["bole"][0].topk, best["bole"][0].budget))
            policies = args.budget_policies if tp is None else []
            for policy in policies:
                spec = SpecConfig("bole", drafter, *tree, profile, draft_vocab=args.draft_vocab,
                                  forced_acceptance=forced, budget_policy=policy,
                                  shared_budget=(batch * (tree[2] - 1) // 2
                                                 if policy_info(policy).shared_budget else 0))
                if args.policy_tree == "best" and not bole_fits:
                    best[f"bole-{policy}"] = (spec, does_not_fit(unfit, None))
                    continue
                if not policy_info(policy).shared_budget:
                    profiles[name] = profile_meta(load_or_calibrate(model, spec,
                                                                    max(args.batches)))
                best[f"bole-{policy}"] = (spec, go(spec, cont))
            for mode in ("chain", "tree-serial", "bole", *(f"bole-{p}" for p in policies)):
                spec, res = best[mode]
                equal = res.pop("outputs") == cont if res["fits"] else None
                records.append(dict(base, mode=mode, equal_to_ar=equal,
                                    shape=dict(depth=spec.depth, topk=spec.topk,
                                               budget=spec.budget),
                                    max_batch_at_context=max_batch(model, spec, args.max_context,
                                                                   args.device), **res))
                print(json.dumps({k: v for k, v in records[-1].items() if k != "outputs"}),
                      flush=True)
            if tp is None or not tp.rank:
                write(args, records, confirmations, profiles)
        if args.confirm_max_batch and args.tp == 1 and "tree-serial" in best:
            spec = best["tree-serial"][0]
            computed = max_batch(model, spec, args.max_context, args.device)
            confirmations.append(dict(model=name, computed_max_batch=computed,
                                      **confirm_max_batch(model, spec, args.max_context,
                                                          args.confirm_batch or computed,
                                                          args.device)))
            print(json.dumps(confirmations[-1]), flush=True)
        del model
    if tp is not None and tp.rank:
        return None
    path = write(args, records, confirmations, profiles)
    print(path, plot(path))
    return path


def write(args, records: list[dict], confirmations: list[dict],
          profiles: dict[str, dict] | None = None) -> Path:
    """The study's JSON (rewritten after every batch, so that a run cut short keeps its
    finished batches); ``confirmations``: the max-batch runs (:func:`confirm`); ``profiles``:
    per model, the calibration the budget policies ran on (:func:`profile_meta`)."""
    meta = dict(date=_dt.date.today().isoformat(), device=(torch.cuda.get_device_name()
                if args.device == "cuda" else "cpu"), **versions(),
                commit=source_commit(), tp=args.tp,
                context=args.context, max_context=args.max_context, max_tokens=args.max_tokens,
                min_run_tokens=args.min_run_tokens,
                draft_vocab=args.draft_vocab,
                throughput_note=("decode_tokens_per_s: tokens after each request's first over "
                                 "the rounds' time (the speculative rounds); "
                                 "full_batch_tokens_per_s: the same over the rounds that ran "
                                 "every slot (a wave's last rounds run only the "
                                 "requests not done yet); tokens_per_s: over the whole run, "
                                 "prefills included"),
                acceptance_note=("presets: random weights, acceptance replayed from profile "
                                 f"{args.profile!r} (bole/speculative/profiles), not measured"
                                 + ("" if args.unforced else
                                    "; greedy acceptance forced to the known continuation")
                                 + ("; bundled: its own MTP head, acceptance measured"
                                    if "bundled" in args.models else "")),
                budget_profiles=profiles or {})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"e2e-{meta['date']}{args.tag}.json"
    path.write_text(json.dumps(dict(meta=meta, records=records,
                                    max_batch_confirmed=confirmations), indent=1))
    return path


def profile_meta(profile) -> dict:
    """A calibration profile's figures for a result file: its GPU, tree size and eps, B_ver, the
    node grid and per batch the decode, verify (over the grid) and selection times in ms."""
    return dict(profile_gpu=profile.gpu, tree_nodes=profile.tree_nodes, eps=profile.eps,
                b_ver=dict(zip(profile.batches, profile.b_ver)), node_grid=profile.node_grid,
                t_dec_ms=dict(zip(profile.batches, profile.t_dec)),
                t_ver_ms=dict(zip(profile.batches, profile.t_ver)),
                t_select_ms=dict(zip(profile.batches, profile.t_select)))


def fastest(candidates: list[tuple[SpecConfig, dict]], model) -> int:
    """Index of the candidate with the most tokens/s: rank 0's pick on every rank (timings
    differ between ranks, the runs that follow must not)."""
    i = max(range(len(candidates)),
            key=lambda j: candidates[j][1]["decode_tokens_per_s"] or float("-inf"))
    return model.tp.broadcast_int(i)


TABLE_MODES = ("chain", "tree-serial", "bole")


def table(paths: list[Path]) -> str:
    """One markdown row per model and batch of the result files: each mode's decode tokens/s
    (its shape), bole's multiples, its accepted tokens a round, round split and peak memory.
    A mode that did not fit the device reads "does not fit"; the last column counts the modes
    whose every request's output equalled ar's."""
    head = ("| model | batch | ar | chain (depth) | tree-serial (shape) | bole (shape) | "
            "bole-goodput | tokens per round | bole / ar | / tree-serial | / chain | "
            "bole round ms (draft/verify/accept/host) | peak GiB (ar/chain/tree-serial/bole) | "
            "outputs equal to ar |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    recs = [r for p in paths for r in json.loads(p.read_text())["records"]]
    models = list(dict.fromkeys(r["model"] for r in recs))
    groups = sorted(dict.fromkeys((r["model"], r["batch"]) for r in recs),
                    key=lambda g: (models.index(g[0]), g[1]))
    for model, batch in groups:
        by = {r["mode"]: r for r in recs if (r["model"], r["batch"]) == (model, batch)}
        ok = {m: r for m, r in by.items() if r.get("fits", True)}
        if "ar" not in by:
            continue
        if "ar" not in ok:                   # nothing ran there: say so
            lines.append("| " + " | ".join([model, str(batch), "does not fit"]
                                           + [""] * (head.count(" | ") - 2)) + " |")
            continue

        def rate(mode: str) -> str:
            if mode not in by:
                return ""
            r = by[mode]
            if mode not in ok:
                return "does not fit"
            sh = r["shape"]
            label = (f" (d{sh['depth']})" if mode == "chain" else
                     f" ({sh['depth']},{sh['topk']},{sh['budget']})")
            return f"{r['decode_tokens_per_s']:.0f}{label}"

        def ratio(mode: str) -> str:
            return (f"{ok['bole']['decode_tokens_per_s'] / ok[mode]['decode_tokens_per_s']:.2f}"
                    if "bole" in ok and mode in ok else "")

        b = ok.get("bole")
        split = (f"{b['round_ms']:.2f} ({b['draft_ms']:.2f}/{b['verify_ms']:.2f}/"
                 f"{b['accept_commit_ms']:.2f}/{b['host_ms']:.2f})" if b else "")
        goodput = ok.get("bole-goodput")
        peaks = "/".join(f"{by[m]['peak_mem_gib']:.1f}" if m in by and by[m]["peak_mem_gib"]
                         else "" for m in ("ar", *TABLE_MODES))
        cells = [model, str(batch), f"{ok['ar']['decode_tokens_per_s']:.0f}",
                 *(rate(m) for m in TABLE_MODES),
                 f"{goodput['decode_tokens_per_s']:.0f}" if goodput else rate("bole-goodput"),
                 f"{b['mean_accepted_tokens']:.2f}" if b else "", ratio("ar"),
                 ratio("tree-serial"), ratio("chain"), split, peaks,
                 f"{sum(bool(r.get('equal_to_ar')) for m, r in ok.items() if m != 'ar')}"
                 f"/{len(ok) - 1}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    data = json.loads(path.read_text())
    models = list(dict.fromkeys(r["model"] for r in data["records"]))
    fig, axes = plt.subplots(2, len(models), figsize=(4.5 * len(models), 7), squeeze=False)
    for j, name in enumerate(models):
        recs = [r for r in data["records"] if r["model"] == name]
        ar = {r["batch"]: r["decode_tokens_per_s"] for r in recs
              if r["mode"] == "ar" and r.get("fits", True)}
        modes = list(dict.fromkeys(r["mode"] for r in recs))
        for mode in modes:
            pts = sorted((r["batch"], r["decode_tokens_per_s"]) for r in recs
                         if r["mode"] == mode and r.get("fits", True) and r["batch"] in ar)
            unfit = sorted(r["batch"] for r in recs if r["mode"] == mode and not
                           r.get("fits", True))
            label = mode + (f" (does not fit at batch {', '.join(map(str, unfit))})"
                            if unfit else "")
            line, = axes[0, j].plot(*(zip(*pts) if pts else ([], [])), marker="o", label=label)
            axes[1, j].plot([b for b, _ in pts], [t / ar[b] for b, t in pts], marker="o",
                            color=line.get_color(), label=label)
        source = (f"replay of {recs[0]['profile']}"
                  if drafter_info(recs[0]["drafter"]).replays_continuation else "its MTP head")
        axes[0, j].set_title(f"{name} ({source}): decode tokens/s", fontsize=9)
        axes[1, j].set_title(f"{name}: speed-up over ar", fontsize=9)
        for ax in axes[:, j]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch")
        axes[0, j].legend(fontsize=7)
    m = data["meta"]
    title = f"{m['device']}, torch {m['torch']}, {m['date']}"
    if any(drafter_info(r["drafter"]).replays_continuation for r in data["records"]):
        title += "; " + m["acceptance_note"]
    fig.suptitle(textwrap.fill(title, 70 * len(models)), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return save_png(fig, path)


if __name__ == "__main__":
    sys.exit(main())
