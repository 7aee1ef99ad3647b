"""The verification budget's policies side by side at batch 1-64 (issue 21's benchmark).

For each model and batch, bole runs with:
    fixed        every request verifies its whole tree (--budget slots; SGLang-Tree style)
    global       a fixed capacity of --global-budget draft nodes for the whole batch (TETRIS)
    oracle       the best global capacity of a sweep (--sweep, and with --sweep-widths every
                 capacity that fills a verify width: batch x (W - 1) for each width W), chosen on
                 other prompts than the ones every policy is measured on (the selection set:
                 other random prompts, or the other half of a model's own prompts), then run on
                 the evaluation prompts like every other policy. Its sweep's best is the
                 luckiest of several runs: with the replay drafter's draws a function of the
                 prompts, running it again on the same prompts repeats its luck in acceptance,
                 not only in timing. ``--oracle-on same`` sweeps the evaluation prompts and runs
                 the best again there
    calibrated   B_ver(batch) from this device's calibration profile (made first if missing), at
                 the profile's eps and at each of --eps-sweep (B_ver derived again from the same
                 curves; the paper leaves eps to the user and reports no sweep of it), each
                 request holding at most what B_ver's verify width holds
    goodput      the budget with the most expected tokens per ms each round, plain decoding
                 when drafting does not pay; its acceptance estimates start from the prior (a
                 fresh process)
    goodput-warm the same, its acceptance estimates first learnt by a goodput run on the
                 selection prompts (the oracle's sweep's prompts; with ``--oracle-on same``
                 the evaluation prompts themselves, ``warmed_on`` says which): a serving process
                 whose engines of the model have run before (the estimates are per model and
                 drafter, shared in a process)
Models: the bundled model with its MTP head (real acceptance) and random-weight presets with the
replay drafter (acceptance from --profile). Each run serves ``--waves`` x batch requests on batch
slots (continuous batching: a finished request's slot takes the next one). Records {model, batch,
policy, budget, prompt_set, tokens_per_s (decode: tokens after each request's first over the
rounds' time), full_batch_tokens_per_s (the same over the rounds that ran every slot: the batch
the record names, without the last wave's ragged end), mean_accepted_tokens, round_ms,
the round's split (draft, verify, accept and commit, host: the GPU idle between them),
plain_round_share (goodput's rounds without drafting), draft_nodes_per_round (draft nodes the
batch verified, shared budgets), rounds_by_draft_depth ([depth, rounds] of the device drafter's
rounds: goodput grows whole rounds to its chosen depth)} go to
bench/results/budget-<date>-<model>.json with a plot. ``--policies`` runs some of them (ar always
runs). ``--eps-table FILE...`` prints, from finished runs (an oracle with ``--sweep-widths``, and
calibrated runs where there are some), the tolerances at which the calibrated rule's choice at
each batch (a width's capacity) comes within 5% of the oracle. ``--repeats N`` runs each
configuration N times and keeps the run of median tokens/s (the bundled model's rounds of about
1 ms differ by several percent between runs of the same work). Each run's goodput starts its
acceptance estimates from the prior, as a fresh process would (``--shared-acceptance`` carries
them over from the runs before it, as engines of one model share them in a process).

``--table FILE...`` prints each batch's policies against the oracle from finished runs.

    python bench/budget.py --models bundled qwen3.5-9b             # on a GPU
    python bench/budget.py --models tiny --batches 1 2 --device cpu --max-tokens 12 --sweep 2 8
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# Run by path, Python puts bench/ first on sys.path: drop it, so that bench's modules are reached
# as bench.<name> and can never shadow, or be shadowed by, an installed package of the same name.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench")]

from bench.e2e import load, profile_meta, prompts_for, run  # noqa: E402
from bench.harness import save_png, source_commit, versions  # noqa: E402

from bole.engine import SpecConfig  # noqa: E402
from bole.engine.calibrate import load_or_calibrate  # noqa: E402
from bole.speculative.budget.acceptance import (  # noqa: E402
    forget_acceptance, restore_acceptance, saved_acceptance)
from bole.speculative.budget.profile import verification_budget  # noqa: E402
from bole.speculative.budget.widths import width_buckets  # noqa: E402
from bole.speculative.drafters.registry import drafter_info  # noqa: E402

#: the selection prompts' seed past the evaluation prompts' (random prompts)
SELECTION_SEED = 7919
#: what --policies can run (the oracle with its sweep)
POLICIES = ("fixed", "global", "oracle", "calibrated", "goodput", "goodput-warm")
#: policies whose count against the oracle the table prints
GOODPUT = ("goodput", "goodput-warm")


def fitted(res: dict, what: str) -> dict:
    """``res`` of :func:`e2e.run`; a run that ran out of device memory ends the benchmark with a
    message (every policy runs the same trees: one that does not fit leaves nothing to
    compare)."""
    if not res["fits"]:
        raise SystemExit(f"budget: {what} does not fit on the device ({res['error']}); run "
                         "fewer --batches or a shorter --context")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["bundled", "qwen3.5-9b"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--profile", default="qwen3-next-mtp", help="replay acceptance (presets)")
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--budget", type=int, default=32, help="per-request tree (fixed policy)")
    ap.add_argument("--global-budget", type=int, default=64, help="the global policy's capacity")
    ap.add_argument("--sweep", type=int, nargs="*", default=[8, 16, 32, 64, 128, 256],
                    help="global capacities the oracle tries")
    ap.add_argument("--sweep-widths", action="store_true",
                    help="the oracle also tries, at each batch, the capacities that fill a verify "
                         "width W: batch x (W - 1) for every width bucket (the verify is dense: "
                         "a width costs the same however full its rows are)")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="the MTP head's draft vocabulary (0: the full vocabulary)")
    ap.add_argument("--eps-sweep", type=float, nargs="*", default=[],
                    help="further tolerances the calibrated policy runs at (records carry eps; a "
                         "tolerance whose budgets equal one already run is not run again)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each configuration; its record is the run of median tokens/s "
                         "(with every run's in tokens_per_s_runs)")
    ap.add_argument("--shared-acceptance", action="store_true",
                    help="let goodput's acceptance estimates carry over from one run to the next "
                         "(as engines of one model share them in a process); by default each "
                         "run starts from the prior, whatever ran before it")
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
                    help="the policies to run (ar always runs: the baseline and, for the replay "
                         "drafter, the continuation every policy is forced along); the oracle "
                         "runs the sweep")
    ap.add_argument("--eps-table", nargs="+", metavar="FILE",
                    help="print the calibrated rule's choices and their sweep rates against the "
                         "oracle from finished runs (with --sweep-widths), and exit")
    ap.add_argument("--oracle-on", choices=("held-out", "same"), default="held-out",
                    help="the prompts the oracle's sweep runs on: held-out ones (its capacity "
                         "then measured on the evaluation prompts), or the evaluation prompts "
                         "themselves (its best run again there)")
    ap.add_argument("--waves", type=int, default=1,
                    help="requests a run serves, in multiples of the batch (continuous batching "
                         "on batch slots)")
    ap.add_argument("--table", nargs="+", metavar="FILE",
                    help="print each batch's policies against the oracle from finished runs, "
                         "and exit")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--tag", default="", help="appended to the file names")
    args = ap.parse_args(argv)
    if args.eps_table:
        print(eps_table([Path(p) for p in args.eps_table]))
        return 0
    if args.table:
        print(policy_table([r for p in args.table
                            for r in json.loads(Path(p).read_text())["records"]]))
        return 0
    if args.repeats < 1 or args.waves < 1:
        ap.error(f"--repeats and --waves must be >= 1, got {args.repeats} and {args.waves}")
    if "oracle" in args.policies and not args.sweep and not args.sweep_widths:
        ap.error("the oracle needs capacities to try: give --sweep N [N ...] or --sweep-widths")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: pass --device cpu for a smoke run", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    date = _dt.date.today().isoformat()
    paths = []
    for name in args.models:
        model, given, drafter, _ = load(name, args.device, dtype)
        replays = drafter_info(drafter).replays_continuation
        acceptance = args.profile if replays else None
        base = SpecConfig("bole", drafter, args.depth, args.topk, args.budget, acceptance,
                          draft_vocab=args.draft_vocab, forced_acceptance=replays)
        profile = load_or_calibrate(model, base, max(args.batches))
        records = []
        for batch in args.batches:
            evaluation, selection = prompt_sets(model, given, batch * args.waves, args.context,
                                                seed=batch)
            if args.oracle_on == "same":
                selection = evaluation

            def baseline(prompts, what):
                ar = fitted(run(model, SpecConfig("ar"), prompts, args.max_tokens, None,
                                args.device, slots=batch), f"ar at batch {batch} ({what})")
                return ar, (ar.pop("outputs") if replays else None)
            ar, cont = baseline(evaluation, "evaluation prompts")
            sets = {"evaluation": (evaluation, ar, cont)}
            if {"oracle", "goodput-warm"} & set(args.policies) and selection is not evaluation:
                sets["selection"] = (selection, *baseline(selection, "selection prompts"))

            def one(policy: str, spec: SpecConfig, budget: int, model=model,
                    budget_profile=None, prompt_set="evaluation", start=None) -> dict:
                prompts, ar, cont = sets[prompt_set]
                runs = []
                for _ in range(args.repeats):
                    if start is not None:          # goodput-warm: from what it learnt first
                        restore_acceptance(model, start)
                    elif not args.shared_acceptance:
                        forget_acceptance(model)
                    runs.append(fitted(run(model, spec, prompts, args.max_tokens, cont,
                                           args.device, slots=batch,
                                           budget_profile=budget_profile),
                                       f"{policy} at batch {batch}"))
                res = sorted(runs, key=lambda r: r["decode_tokens_per_s"])[len(runs) // 2]
                rec = dict(model=name, batch=batch, policy=policy, budget=budget,
                           prompt_set=prompt_set, requests=len(prompts),
                           tokens_per_s=res["decode_tokens_per_s"],
                           full_batch_tokens_per_s=res["full_batch_tokens_per_s"],
                           full_batch_rounds=res["full_batch_rounds"],
                           batch_rounds=res["batch_rounds"],
                           mean_accepted_tokens=res["mean_accepted_tokens"],
                           round_ms=res["round_ms"], ar_tokens_per_s=ar["decode_tokens_per_s"],
                           ar_full_batch_tokens_per_s=ar["full_batch_tokens_per_s"],
                           draft_ms=res["draft_ms"], verify_ms=res["verify_ms"],
                           accept_commit_ms=res["accept_commit_ms"], host_ms=res["host_ms"],
                           plain_round_share=res["plain_round_share"],
                           draft_nodes_per_round=res["draft_nodes_per_round"],
                           rounds_by_draft_nodes=res["rounds_by_draft_nodes"],
                           rounds_by_draft_depth=res["rounds_by_draft_depth"],
                           acceptance_estimates=res["acceptance_estimates"],
                           tokens_per_s_runs=[r["decode_tokens_per_s"] for r in runs])
                print(json.dumps(rec), flush=True)
                return rec
            if "fixed" in args.policies:
                records.append(one("fixed", base, batch * (base.nodes_per_request - 1)))
            if "global" in args.policies:
                records.append(one("global", replace(base, budget_policy="global",
                                                     shared_budget=args.global_budget),
                                   args.global_budget))
            if "oracle" in args.policies:
                capacities = set(args.sweep)
                if args.sweep_widths:
                    capacities |= {batch * (w - 1) for w in width_buckets(base.nodes_per_request)}
                on = "selection" if "selection" in sets else "evaluation"
                sweep = [one("sweep", replace(base, budget_policy="global", shared_budget=n), n,
                             prompt_set=on)
                         for n in sorted(capacities)]
                records += sweep
                best = max(sweep, key=lambda r: r["tokens_per_s"])
                oracle = one("oracle", replace(base, budget_policy="global",
                                               shared_budget=best["budget"]), best["budget"])
                records.append(dict(oracle, sweep_best_tokens_per_s=best["tokens_per_s"],
                                    chosen_on=on))
            ran: dict[tuple, dict] = {}
            tolerances = [profile.eps, *args.eps_sweep] if "calibrated" in args.policies else []
            for eps in dict.fromkeys(tolerances):
                at = profile.at_eps(eps)
                # the budgets of every bucket a shrinking batch passes through
                budgets = tuple(verification_budget(at, n) for n in range(1, batch + 1))
                policy = "calibrated" if eps == profile.eps else "calibrated-eps"
                if budgets in ran:        # the same rounds: its figures, marked as shared
                    rec = dict(ran[budgets], policy=policy, eps=eps,
                               same_run_as_eps=ran[budgets]["eps"])
                else:
                    rec = ran[budgets] = dict(one(policy, replace(base, budget_policy="calibrated"),
                                                  budgets[-1], budget_profile=at), eps=eps)
                records.append(rec)
            goodput = replace(base, budget_policy="goodput")
            if "goodput" in args.policies:
                records.append(one("goodput", goodput, -1))
            if "goodput-warm" in args.policies:
                on = "selection" if "selection" in sets else "evaluation"
                prompts, _, cont = sets[on]
                forget_acceptance(model)
                fitted(run(model, goodput, prompts, args.max_tokens, cont, args.device,
                           slots=batch), f"goodput's warm-up at batch {batch}")
                records.append(dict(one("goodput-warm", goodput, -1,
                                        start=saved_acceptance(model)), warmed_on=on))
            # rewritten after every batch: a run cut short keeps its finished batches
            meta = dict(date=date, model=name, drafter=drafter, acceptance=acceptance,
                        draft_vocab=args.draft_vocab,
                        device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                        **versions(), commit=source_commit(),
                        **profile_meta(profile))
            path = out / f"budget-{date}-{name}{args.tag}.json"
            path.write_text(json.dumps(dict(meta=meta, records=records), indent=1))
        paths += [path, plot(path)]
        print(policy_table(records))
        del model
    print(*paths, sep="\n")
    return 0


def prompt_sets(model, given, count: int, context: int, seed: int) -> tuple[list, list]:
    """``(evaluation, selection)``: ``count`` prompts each. A model's own prompts (``given``)
    split in two, the even-numbered ones to evaluate and the odd-numbered ones to select on,
    each cycled to ``count`` (one prompt: both sets the same); random prompts of seeds ``seed``
    and ``seed + SELECTION_SEED``."""
    if given is not None:
        halves = (given[0::2], given[1::2]) if len(given) > 1 else (given, given)
        return tuple([half[i % len(half)] for i in range(count)] for half in halves)
    return (prompts_for(model, None, count, context, seed=seed),
            prompts_for(model, None, count, context, seed=seed + SELECTION_SEED))


def policy_table(records: list[dict]) -> str:
    """Markdown: per model and batch, each policy's tokens/s over the oracle's (all rounds, and
    the rounds that ran every slot) and over ar, the oracle's capacity and where it was chosen;
    then per model how many batches goodput (and goodput-warm) is at or above the oracle."""
    lines = ["| model | batch | policy | budget | tokens/s | / oracle | full batch / oracle "
             "| / ar |", "|---|---|---|---|---|---|---|---|"]
    counts: dict[tuple[str, str], list[int]] = {}     # (model, policy) -> counts
    for model in dict.fromkeys(r["model"] for r in records):
        mine = [r for r in records if r["model"] == model]
        for batch in sorted({r["batch"] for r in mine}):
            at = [r for r in mine if r["batch"] == batch and r["policy"] != "sweep"]
            oracle = next((r for r in at if r["policy"] == "oracle"), None)
            for r in at:
                def over(key, base=oracle):
                    return f"{r[key] / base[key]:.3f}" if base and base.get(key) and \
                        r.get(key) else "-"
                name = r["policy"] + (f" (eps {r['eps']:g})" if "eps" in r else "") + \
                    (f" (chosen on {r['chosen_on']})" if "chosen_on" in r else "")
                lines.append(f"| {model} | {batch} | {name} | {r['budget']} | "
                             f"{r['tokens_per_s']:.0f} | {over('tokens_per_s')} | "
                             f"{over('full_batch_tokens_per_s')} | "
                             f"{r['tokens_per_s'] / r['ar_tokens_per_s']:.2f} |")
                if r["policy"] in GOODPUT and oracle:
                    c = counts.setdefault((model, r["policy"]), [0, 0, 0, 0])
                    c[0] += r["tokens_per_s"] >= oracle["tokens_per_s"]
                    c[1] += 1
                    if r.get("full_batch_tokens_per_s") and \
                            oracle.get("full_batch_tokens_per_s"):
                        c[2] += r["full_batch_tokens_per_s"] >= oracle["full_batch_tokens_per_s"]
                        c[3] += 1
    lines.append("")
    for (model, policy), (rate, n, full, m) in counts.items():
        lines.append(f"{model}: {policy} >= the oracle at {rate} of {n} batches (all rounds)"
                     + (f", {full} of {m} (rounds that ran every slot)" if m else ""))
    return "\n".join(lines)


def rule_choices(meta: dict, batch: int) -> list[tuple[float, int]]:
    """The calibrated rule's choices at ``batch`` from a result file's profile figures: ``(eps
    from which it holds, B_ver)`` in ascending eps, as the profile derives B_ver
    (:func:`bole.speculative.budget.profile.b_ver_from_curve`)."""
    from bole.speculative.budget.profile import b_ver_from_curve
    t_dec, t_ver = meta["t_dec_ms"][str(batch)], meta["t_ver_ms"][str(batch)]
    out: list[tuple[float, int]] = []
    for eps in sorted({max(t / t_dec - 1.0, 0.0) for t in t_ver}):
        # the tolerance at which this point passes (a hair above, for the rounding of 1 + eps)
        n = b_ver_from_curve(t_dec, meta["node_grid"], t_ver, eps + 1e-12, rows=batch,
                             tree_nodes=meta["tree_nodes"])
        if not out or n != out[-1][1]:
            out.append((eps, n))
    return out


def eps_table(paths: list[Path], within: float = 0.95) -> str:
    """Markdown: per batch of finished runs, each tolerance range of the calibrated rule, the
    capacity it picks there and that capacity's rate against the oracle; then the tolerances at
    which every batch comes within ``within`` of its oracle (none, where no eps does).

    The oracle and the rule's choices (the profile's figures in the meta) come from the first
    file holding the batch's oracle (a run with ``--sweep-widths``). A capacity's rate is the
    calibrated policy's own run at that budget where a file holds one ("calibrated"; the last
    file's, where several do), else the oracle's sweep at that capacity ("sweep": the global
    policy, without the calibrated policy's per-row cap, which a capacity that lands unevenly
    needs). Rates from different runs are compared as multiples of their own run's ar. Where
    the oracle was chosen on held-out prompts, the sweep's rates are compared with the sweep's
    best (its own prompts) and the calibrated runs' with the oracle's run."""
    found: dict[int, tuple[dict, dict]] = {}        # batch -> (meta, oracle record)
    rates: dict[tuple[int, int, str], float] = {}   # (batch, budget, source) -> multiple of ar
    best: dict[int, float] = {}                     # batch -> the sweep's best multiple of ar
    for path in paths:
        data = json.loads(Path(path).read_text())
        for r in data["records"]:
            multiple = r["tokens_per_s"] / r.get("ar_tokens_per_s", 1.0)
            if r["policy"] == "oracle" and r["batch"] not in found:
                found[r["batch"]] = (data["meta"], r)
            elif r["policy"] == "sweep":
                rates.setdefault((r["batch"], r["budget"], "sweep"), multiple)
                if r.get("prompt_set") == "selection":
                    best[r["batch"]] = max(best.get(r["batch"], 0.0), multiple)
            elif r["policy"].startswith("calibrated"):
                rates[(r["batch"], r["budget"], "calibrated")] = multiple
    batches = sorted({b for b, _, _ in rates} | set(found))
    missing = [b for b in batches if b not in found]
    if missing:
        raise SystemExit(f"batch {missing[0]} has no oracle in {', '.join(map(str, paths))}; "
                         "--eps-table needs a run of the oracle with --sweep-widths")
    rows, ranges = [], []
    for batch in batches:
        meta, oracle = found[batch]
        bases = {"calibrated": oracle["tokens_per_s"] / oracle.get("ar_tokens_per_s", 1.0)}
        held_out = oracle.get("chosen_on") == "selection" and batch in best
        bases["sweep"] = best[batch] if held_out else bases["calibrated"]
        choices = rule_choices(meta, batch)
        good = []
        for i, (lo, cap) in enumerate(choices):
            hi = choices[i + 1][0] if i + 1 < len(choices) else float("inf")
            source = next((s for s in ("calibrated", "sweep") if (batch, cap, s) in rates), None)
            share = rates[(batch, cap, source)] / bases[source] if source else 0.0
            rows.append(f"| {batch} | {lo:.3f}-{hi:.3f} | {cap} | "
                        + (f"{share:.3f} | {source} |" if source else "not run | |"))
            if share >= within and good and good[-1][1] == lo:       # adjacent: one range
                good[-1] = (good[-1][0], hi)
            elif share >= within:
                good.append((lo, hi))
        ranges.append((batch, good))
    lines = ["| batch | eps | B_ver | rate / oracle | from |", "|---|---|---|---|---|", *rows, ""]
    common = [(0.0, float("inf"))]
    for batch, good in ranges:
        common = [(max(a, c), min(b, d)) for a, b in common for c, d in good
                  if max(a, c) < min(b, d)]
        lines.append(f"batch {batch}: within {within:g} of the oracle at eps "
                     + (", ".join(f"{a:.3f}-{b:.3f}" for a, b in good) or "none"))
    lines.append(f"every batch within {within:g}: eps "
                 + (", ".join(f"{a:.3f}-{b:.3f}" for a, b in common) or "none"))
    return "\n".join(lines)


def plot(path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    data = json.loads(path.read_text())
    recs = [r for r in data["records"] if r["policy"] != "sweep"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for policy in POLICIES:
        pts = sorted((r["batch"], r["tokens_per_s"] / r["ar_tokens_per_s"]) for r in recs
                     if r["policy"] == policy)
        if pts:       # goodput-warm often lies on goodput: dashed, so both show
            ax.plot(*zip(*pts), marker="o", label=policy,
                    ls="--" if policy == "goodput-warm" else "-")
    for eps in sorted({r["eps"] for r in recs if r["policy"] == "calibrated-eps"}):
        pts = sorted((r["batch"], r["tokens_per_s"] / r["ar_tokens_per_s"]) for r in recs
                     if r["policy"] == "calibrated-eps" and r["eps"] == eps)
        ax.plot(*zip(*pts), ls=":", marker=".", label=f"calibrated, eps {eps:g}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_ylabel("tokens/s over ar")
    m = data["meta"]
    named = ", ".join(f"{k} {m[k]}" for k in ("torch", "triton", "fla") if m.get(k))
    ax.set_title(f"{m['model']} ({m['drafter']}{', ' + m['acceptance'] if m['acceptance'] else ''})"
                 f" on {m['device']}, {m['date']}" + (f"\n{named}" if named else ""),
                 fontsize=8)
    ax.legend(fontsize=8)
    return save_png(fig, path)


if __name__ == "__main__":
    sys.exit(main())
