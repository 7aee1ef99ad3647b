"""Measure the bundled model's MTP acceptance profile (issue 23) and fit the published one.

The replay drafter (bole/speculative/drafters/replay.py) needs Sequoia's positional acceptance vector
p_1..p_k of a drafter: p_i = P(the rank-i proposal at an on-path node is the target's greedy token).

``bundled``: the bundled model decodes held-out prompts greedily (plain decoding, fp32, CPU). Then,
at every generated position ctx whose next ``depth`` tokens are known, its MTP head drafts a chain
along the target's own tokens, exactly as the tree growth drafts an on-path branch: depth 1 reads
the target's hidden state, depth d > 1 the head's own output at depth d - 1, and the head's KV holds
the committed positions plus the chain's own entries (``MTPDrafter.step_fn``). At each depth we
record the rank of the target's greedy token among the head's top-``ranks`` proposals;
p_i = (samples where rank i was the target's token) / (all samples), pooled over depths 1..depth
(the replay drafter assumes one vector for all depths; the per-depth vectors are kept in the JSON).

``qwen3-next-mtp`` (``--published-out``): p_1 fitted to SGLang's published chain accept lengths of
Qwen3-Next's MTP head (3 steps, top-1, 4 draft tokens), ranks >= 2 by the measured head's shares
(see ``PUBLISHED`` and ``fit_published``).

    python train/measure_acceptance.py --quick             # about 20 s on 2 CPU cores
    python train/measure_acceptance.py --engine-check --out bole/speculative/profiles/bundled.json \
        --published-out bole/speculative/profiles/qwen3-next-mtp.json   # the shipped files

The measurement itself takes about a minute on 2 CPU cores; ``--engine-check`` adds the engine's
real-head tree and chain runs on the same prompts (about ten minutes), so that the JSON records the
profile's predicted tokens per round next to the real head's.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bole.assets import BUNDLED_MODEL, code_prompts  # noqa: E402
from bole.engine import Engine, SamplingParams, SpecConfig  # noqa: E402
from bole.models.qwen3_hybrid import HybridModel  # noqa: E402
from bole.speculative.drafters.draft_vocab import draft_vocab_ids  # noqa: E402
from bole.speculative.drafters.mtp import MTPDrafter  # noqa: E402
from bole.speculative.drafters.replay import AcceptanceProfile, chain_accept_length  # noqa: E402
from bole.speculative.tree_growth import NodeTable  # noqa: E402
from bole.engine.runner import ModelRunner  # noqa: E402

#: SGLang's reported chain accept lengths of Qwen3-Next-80B-A3B's MTP head: speculative
#: decoding with 3 steps, top-1 (eagle-topk 1), 4 draft tokens, greedy
PUBLISHED = {"MT-Bench": 2.59, "GSM8K": 3.13, "HumanEval": 3.45, "MATH500": 3.52}
PUBLISHED_STEPS = 3


# ---------------------------------------------------------------- prompts and greedy decoding

def _eval_module():
    path = ROOT / "train" / "eval_bundled.py"
    spec = importlib.util.spec_from_file_location("eval_bundled", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_prompts(kind: str, tokenizer, count: int, length: int) -> list[list[int]]:
    """``heldout``: windows of the held-out standard-library modules (train/eval_bundled.py's
    split and sampler, seed 0); ``bundled``: bole/bundled/prompts.json."""
    if kind == "heldout":
        return _eval_module().heldout_prompts(tokenizer, count, length)
    return [tokenizer.encode(p).ids for p in code_prompts()[:count]]


def greedy(model: HybridModel, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Plain greedy decoding's ``new_tokens`` tokens for every prompt."""
    max_len = max(len(p) for p in prompts) + new_tokens + 4
    engine = Engine(model, SpecConfig(mode="ar"), max_slots=8, max_len=max_len)
    out = []
    for i in range(0, len(prompts), 8):
        res = engine.generate(prompts[i:i + 8],
                              SamplingParams(max_tokens=new_tokens, ignore_eos=True), seed=0)
        out += [r.token_ids for r in res]
    return out


# ---------------------------------------------------------------- the chain measurement

def chain_table(roots: torch.Tensor, chain: torch.Tensor) -> NodeTable:
    """A node table holding, per row, the chain ``roots [R]`` -> ``chain [R, D]`` in slots
    0..D (slot d at depth d): the layout a top-1 growth gives, with the target's tokens."""
    R, D = chain.shape
    table = NodeTable.empty(roots, D + 1)
    table.tokens[:, 1:] = chain
    table.parents[:, 1:] = torch.arange(D)
    table.depth[:] = torch.arange(D + 1)
    table.live[:] = True
    table.rho[:] = 1.0
    table.ancestors[:] = torch.tril(torch.ones(D + 1, D + 1, dtype=torch.bool))
    return table


@torch.no_grad()
def measure_ranks(model: HybridModel, sequences: list[list[int]], starts: list[int], depth: int,
                  ranks: int, vocab_ids: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranks of the target's tokens among the MTP head's proposals along on-path chains.

    ``sequences[r]`` is prompt + greedy continuation, whose generated part begins at position
    ``starts[r]``. Returns ``rank [N, depth]`` (0-based rank of the target's token at each depth
    of each chain, ``ranks`` where it is not among the top ``ranks``) and ``row [N]``.
    ``vocab_ids``: the head drafts over these tokens only (a reduced draft vocabulary; a target
    token outside it is never proposed).

    Every sequence is prefilled whole into its own slot (the target's hidden states; the head's
    pool by ``observe_prompt``); before each chain the head's last hidden state becomes the
    target's at ``ctx - 1``, what a round starting at ``ctx`` reads. Chains then go from the last
    root position down to the first: a chain at ``ctx`` writes the head's scratch rows
    ``ctx - 1 ..``, which only chains at larger ``ctx`` would read, and those ran before."""
    R = len(sequences)
    max_len = max(len(s) for s in sequences) + depth + 2
    cache = model.new_cache(R, max_len)
    runner = ModelRunner(model, cache, "torch")
    mtp = MTPDrafter(model, R, max_len, depth + 1, vocab_ids=vocab_ids)
    seqs = [torch.tensor(s, dtype=torch.int64) for s in sequences]
    hiddens = []
    for r, s in enumerate(seqs):
        slot = cache.allocate(len(s))
        assert slot == r
        _, hidden = runner.prefill(slot, s)
        mtp.observe_prompt(slot, s, hidden)
        hiddens.append(hidden)
    # roots at positions starts[r] .. len - 1 - depth (the chain's tokens must be known)
    last = torch.tensor([len(s) - 1 - depth for s in seqs])
    first = torch.tensor(starts)
    slots = torch.arange(R, dtype=torch.int32)
    out_rank, out_row = [], []
    for j in range(int((last - first).max()) + 1):
        ctx = last - j
        valid = ctx >= first
        ctx = torch.where(valid, ctx, 1)
        idx = ctx[:, None] + torch.arange(depth + 1)
        tokens = torch.stack([s[i.clamp(max=len(s) - 1)] for s, i in zip(seqs, idx)])
        table = chain_table(tokens[:, 0], tokens[:, 1:])
        # the root reads the target's hidden state at ctx - 1, as after a real commit there
        for r in range(R):
            mtp.last_hidden[r] = hiddens[r][int(ctx[r]) - 1]
        step = mtp.step_fn(slots, ctx, ranks)
        rank = torch.full((R, depth), ranks, dtype=torch.int64)
        for d in range(depth):                      # frontier: the depth-d node, slot d
            proposals, _ = step(d, torch.full((R, 1), d, dtype=torch.int64), table)
            want = tokens[:, d + 1]
            hit = proposals[:, 0] == want[:, None]                            # [R, ranks]
            rank[:, d] = torch.where(hit.any(1), hit.int().argmax(1), ranks)
        out_rank.append(rank[valid])
        out_row.append(torch.arange(R)[valid])
    return torch.cat(out_rank), torch.cat(out_row)


def summarise(rank: torch.Tensor, ranks: int) -> dict:
    """Pooled and per-depth rank shares, and chain accept lengths measured vs predicted."""
    N, depth = rank.shape
    counts = torch.stack([(rank == i).sum(0) for i in range(ranks + 1)], 1)    # [depth, ranks + 1]
    pooled = counts.sum(0)
    p = (pooled[:ranks].double() / pooled.sum()).tolist()
    # a top-1 chain of `depth` drafts accepts the leading run of rank-1 hits
    run = torch.cumprod((rank == 0).int(), dim=1).sum(1).double()
    return dict(
        rank_acceptance=p,
        samples=int(pooled.sum()), chains=N,
        counts_by_rank=pooled[:ranks].tolist(), misses=int(pooled[ranks]),
        per_depth=[dict(depth=d + 1, samples=int(counts[d].sum()),
                        rank_acceptance=(counts[d, :ranks].double() / counts[d].sum()).tolist())
                   for d in range(depth)],
        chain=dict(depth=depth, measured_accept_length=float(1 + run.mean()),
                   profile_accept_length=chain_accept_length(p[0], depth)),
    )


def engine_check(model: HybridModel, prompts: list[list[int]], p: list[float], depth: int,
                 new_tokens: int, topk: int = 4, budget: int = 32) -> dict:
    """Tokens per round of the engine with the real head (train/eval_bundled.py's ``measure``:
    a depth-``depth`` top-``topk`` tree of ``budget`` nodes, and a chain) on the same prompts,
    next to what the replay drafter's model predicts for this profile."""
    ev, profile = _eval_module(), AcceptanceProfile("measured", "this run", tuple(p))
    tree = ev.measure(model, prompts, "bole", "mtp", depth, topk, budget, new_tokens)
    chain = ev.measure(model, prompts, "chain", "mtp", depth, 1, depth + 1, new_tokens)
    return dict(
        tree=dict(depth=depth, topk=topk, budget=budget,
                  real_head_accept_length=tree["mean_accepted_tokens"],
                  profile_accept_length=profile.tree_accept_length(depth, topk, budget)),
        chain=dict(depth=depth, real_head_accept_length=chain["mean_accepted_tokens"],
                   profile_accept_length=profile.chain_accept_length(depth)))


def vocab_sweep(model: HybridModel, sequences: list[list[int]], starts: list[int], depth: int,
                ranks: int, sizes: list[int], full: dict) -> list[dict]:
    """What a reduced draft vocabulary costs in acceptance: for each size (the most frequent
    tokens of the model's training counts), the rank acceptance of the same on-path chains, the
    measured top-1 chain accept length, the share of the target's greedy tokens inside the draft
    vocabulary, and the replay model's tokens per round of a depth-``depth`` top-4 tree of 32
    nodes. ``full``: the whole vocabulary's summary (the first row)."""
    generated = torch.cat([torch.tensor(s[st:]) for s, st in zip(sequences, starts)])

    def row(size: int, summary: dict, ids: torch.Tensor | None) -> dict:
        p = summary["rank_acceptance"]
        profile = AcceptanceProfile("sweep", "this run", tuple(p))
        inside = 1.0 if ids is None else float(torch.isin(generated, ids.cpu()).double().mean())
        return dict(draft_vocab=size, greedy_tokens_inside=inside, rank_acceptance=p,
                    chain_accept_length=summary["chain"]["measured_accept_length"],
                    tree_accept_length=profile.tree_accept_length(depth, 4, 32))

    rows = [row(model.config.vocab_size, full, None)]
    for size in sizes:
        ids = draft_vocab_ids(model, size)
        rank, _ = measure_ranks(model, sequences, starts, depth, ranks, vocab_ids=ids)
        rows.append(row(size, summarise(rank, ranks), ids))
        print(f"[measure] draft vocabulary {size}: chain {rows[-1]['chain_accept_length']:.3f}, "
              f"tree {rows[-1]['tree_accept_length']:.3f} tokens a round", file=sys.stderr)
    return rows


def plot_vocab_sweep(rows: list[dict], title: str, path: Path, depth: int = 8) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    rows = sorted(rows, key=lambda r: r["draft_vocab"])
    sizes = [r["draft_vocab"] for r in rows]
    for key, label in (("tree_accept_length", f"depth-{depth} top-4 tree of 32 (replay model)"),
                       ("chain_accept_length", f"depth-{depth} chain (measured)")):
        ax.plot(sizes, [r[key] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    for r in rows:
        ax.annotate(f"{100 * r['greedy_tokens_inside']:.1f}% inside",
                    (r["draft_vocab"], r["chain_accept_length"]), fontsize=7,
                    textcoords="offset points", xytext=(0, -12), ha="center")
    ax.set_xlabel("draft vocabulary (most frequent tokens)")
    ax.set_ylabel("tokens a round")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- the published profile

def solve_rate(length: float, steps: int) -> float:
    """The per-step acceptance a with ``1 + a + .. + a**steps == length`` (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chain_accept_length(mid, steps) < length else (lo, mid)
    return (lo + hi) / 2


def fit_published(shape: list[float]) -> dict:
    """The ``qwen3-next-mtp`` profile: p_1 by least squares on the four published accept lengths,
    ranks >= 2 as ``(1 - p_1) * s_i`` with ``s_i = p_i / (1 - p_1)`` of ``shape`` (the measured
    bundled head's share of rank-1 misses that rank i catches)."""
    per = {k: solve_rate(v, PUBLISHED_STEPS) for k, v in PUBLISHED.items()}
    geo = math.exp(sum(math.log(a) for a in per.values()) / len(per))
    # least squares: d/da sum (L(a) - L_k)^2 = 0 <=> L(a) = mean(L_k) (L increasing in a)
    mean_len = sum(PUBLISHED.values()) / len(PUBLISHED)
    p1 = solve_rate(mean_len, PUBLISHED_STEPS)
    miss = 1.0 - shape[0]
    shares = [q / miss for q in shape[1:]]
    p = [p1] + [(1.0 - p1) * s for s in shares]
    p = [math.floor(x * 1e6) / 1e6 for x in p]            # 6 decimals, rounded down: sum <= 1
    return dict(
        name="qwen3-next-mtp",
        source=("SGLang's published accept lengths of Qwen3-Next-80B-A3B's MTP head, speculative "
                "decoding with 3 steps, top-1, 4 draft tokens: 2.59 MT-Bench, 3.13 GSM8K, "
                "3.45 HumanEval, 3.52 MATH500 (as quoted in issue 23). Ranks >= 2: the bundled "
                "model's measured MTP head (bole/speculative/profiles/bundled.json)."),
        rank_acceptance=p,
        notes=(
            "p_1: a top-1 chain of k = 3 drafts, each accepted with probability a given its "
            "parent was, has expected accept length L(a) = 1 + a + a^2 + a^3 (the 1 is the "
            "target's own token). Solved per benchmark: "
            + ", ".join(f"{k} {v:.4f}" for k, v in per.items())
            + f" (geometric mean {geo:.4f}). p_1 is the least-squares fit of one a to the four "
            f"lengths, min_a sum_k (L(a) - L_k)^2, whose optimum has L(a) = mean L_k = "
            f"{mean_len:.4f}: a = {p1:.6f}. Assumptions: (1) acceptance is the same at every "
            "depth (the replay's model); (2) ranks >= 2 are not published, so p_i = (1 - p_1) * "
            "s_i for i >= 2, where s_i = p_i^b / (1 - p_1^b) is the share of the bundled MTP "
            "head's rank-1 misses caught at rank i (measured, pooled over depths 1-8 on held-out "
            "code), i.e. the larger head misses less often but, when it misses, ranks the target's "
            "token like the small one does; ranks past the measured ones never hold it. Values "
            "rounded down to 6 decimals."),
        fit=dict(published_accept_lengths=PUBLISHED, steps=PUBLISHED_STEPS,
                 per_benchmark_rate=per, geometric_mean_rate=geo, least_squares_rate=p1,
                 rank_shares_from_bundled=shares,
                 profile_accept_length_3_steps=chain_accept_length(p1, PUBLISHED_STEPS)),
    )


# ---------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(BUNDLED_MODEL))
    ap.add_argument("--prompts", choices=("heldout", "bundled"), default="heldout")
    ap.add_argument("--count", type=int, default=32, help="prompts (held-out windows)")
    ap.add_argument("--prompt-len", type=int, default=128, help="tokens per held-out window")
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--depth", type=int, default=8, help="chain depth measured")
    ap.add_argument("--ranks", type=int, default=8, help="top-k ranks recorded")
    ap.add_argument("--quick", action="store_true", help="8 prompts of 64 tokens, 32 new tokens")
    ap.add_argument("--engine-check", action="store_true",
                    help="also run the engine with the real head (depth-8 top-4 tree of 32 nodes, "
                         "chain) and compare its tokens per round with the profile's prediction")
    ap.add_argument("--out", default=None, help="write the bundled profile JSON here")
    ap.add_argument("--published-out", default=None,
                    help="also write the qwen3-next-mtp profile (fitted) here")
    ap.add_argument("--draft-vocab", type=int, nargs="+", default=[],
                    help="also measure the same chains with the head drafting over only this many "
                         "most frequent tokens (bole/speculative/drafters/draft_vocab.py), each size")
    ap.add_argument("--vocab-out", default=None,
                    help="write the draft-vocabulary sweep's JSON here (and its plot beside it)")
    args = ap.parse_args(argv)
    if args.vocab_out and not args.draft_vocab:
        ap.error("--vocab-out writes the --draft-vocab sweep: name its sizes")
    if any(not args.ranks <= n for n in args.draft_vocab):
        ap.error(f"--draft-vocab sizes must be at least --ranks ({args.ranks}): the head "
                 f"proposes its top {args.ranks}")
    if args.quick:
        args.count, args.prompt_len, args.new_tokens = 8, 64, 32
    torch.set_grad_enabled(False)
    from tokenizers import Tokenizer
    t0 = time.perf_counter()
    model = HybridModel.from_pretrained(args.model, dtype=torch.float32, gdn_backend="torch")
    tok = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    prompts = load_prompts(args.prompts, tok, args.count, args.prompt_len)
    outputs = greedy(model, prompts, args.new_tokens)
    print(f"[measure] greedy decoding of {len(prompts)} prompts: {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    sequences, starts = [p + o for p, o in zip(prompts, outputs)], [len(p) for p in prompts]
    rank, _ = measure_ranks(model, sequences, starts, args.depth, args.ranks)
    summary = summarise(rank, args.ranks)
    sweep = (vocab_sweep(model, sequences, starts, args.depth, args.ranks, args.draft_vocab,
                         summary) if args.draft_vocab else None)
    check = (engine_check(model, prompts, summary["rank_acceptance"], args.depth, args.new_tokens)
             if args.engine_check else None)
    seconds = time.perf_counter() - t0
    where = ("held-out standard-library modules (train/eval_bundled.py's windows, seed 0)"
             if args.prompts == "heldout" else "bole/bundled/prompts.json")
    profile = dict(
        name="bundled",
        source=(f"measured by train/measure_acceptance.py: the bundled model's MTP head "
                f"(bole/bundled, fp32, CPU) on {len(prompts)} prompts from {where}, "
                f"{args.new_tokens} greedy tokens each"),
        rank_acceptance=summary["rank_acceptance"],
        notes=(f"p_i = share of samples where the head's rank-i proposal was the target's greedy "
               f"token. A sample is one depth of an on-path chain: at each generated position "
               f"whose next {args.depth} tokens are known, the head drafts along the target's own "
               f"tokens (depth 1 from the target's hidden state, deeper from its own output, as "
               f"in the tree growth) and the target's token's rank among the top {args.ranks} is "
               f"recorded; pooled over depths 1-{args.depth} ({summary['samples']} samples, "
               f"{summary['misses']} outside the top {args.ranks}). Per-depth vectors below. "
               f"Chain check: a depth-{args.depth} top-1 chain accepts "
               f"{summary['chain']['measured_accept_length']:.3f} tokens on average when one "
               f"starts at every generated position (long easy spans counted at each of their "
               f"positions), the profile predicts {summary['chain']['profile_accept_length']:.3f}."
               + ("" if check is None else
                  f" Engine check on the same prompts (the real head, tokens per round): tree "
                  f"depth {args.depth} top-4 32 nodes "
                  f"{check['tree']['real_head_accept_length']:.3f} "
                  f"(profile: {check['tree']['profile_accept_length']:.3f}), chain depth "
                  f"{args.depth} {check['chain']['real_head_accept_length']:.3f} (profile: "
                  f"{check['chain']['profile_accept_length']:.3f}).")),
        measurement=dict(
            date=datetime.date.today().isoformat(), model=str(Path(args.model).name),
            dtype="float32", device="cpu", torch=torch.__version__, prompts=args.prompts,
            count=len(prompts), prompt_len=args.prompt_len, new_tokens=args.new_tokens,
            depth=args.depth, ranks=args.ranks, seconds=round(seconds, 1),
            **{k: v for k, v in summary.items() if k != "rank_acceptance"},
            **({} if check is None else {"engine_check": check})),
    )
    AcceptanceProfile.from_dict(profile, "measured profile")             # validate before writing
    text = json.dumps(profile, indent=1) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    if args.published_out:
        published = fit_published(summary["rank_acceptance"])
        AcceptanceProfile.from_dict(published, "fitted profile")
        Path(args.published_out).write_text(json.dumps(published, indent=1) + "\n")
        print(json.dumps(published, indent=1))
    if sweep is not None:
        report = dict(
            date=datetime.date.today().isoformat(), model=str(Path(args.model).name),
            dtype="float32", device="cpu", torch=torch.__version__, prompts=args.prompts,
            count=len(prompts), prompt_len=args.prompt_len, new_tokens=args.new_tokens,
            depth=args.depth, ranks=args.ranks,
            command="python train/measure_acceptance.py " + " ".join(argv or sys.argv[1:]),
            note=("draft vocabulary: the most frequent tokens of the model's training counts "
                  "(token_counts.json); the target verifies over its full vocabulary. "
                  "tree_accept_length: the replay drafter's expected tokens a round for this "
                  "rank acceptance (the full vocabulary's prediction was within 1% of the real "
                  "head's tokens a round); chain_accept_length: measured."),
            sizes=sweep)
        print(json.dumps(report, indent=1))
        if args.vocab_out:
            path = Path(args.vocab_out)
            path.write_text(json.dumps(report, indent=1) + "\n")
            plot_vocab_sweep(sweep, f"{report['model']} MTP head, {len(prompts)} "
                             f"{args.prompts} prompts, fp32 CPU, {report['date']}",
                             path.with_suffix(".png"), args.depth)
    print(f"[measure] done in {seconds:.1f} s: p = "
          + ", ".join(f"{x:.3f}" for x in summary["rank_acceptance"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
