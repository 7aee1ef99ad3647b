"""Side-by-side timing of the verification kernel against another version of it (H200 METHOD.md).

``--base FILE`` is a copy of ``bole/ops/gdn/verify/kernel.py`` from another revision (say
``git show f467084:bole/ops/gdn/verify/kernel.py > .run/tv_base.py``); it is imported as its own
module, so both kernels compile and run in one process, and each round times the two in turn
(the order alternating round to round) on the same inputs, as bench/harness.py times them
(CUDA-graph replay over rotating input sets, median per call, pick_config's launch).

Each round also times the launch overheads around the kernel: the call as bench/harness.py
made it before 2026-11-30 (no ``state_indices``, so the wrapper builds ``arange(R)`` on the
device: one more kernel in the graph), ``arange`` alone and an empty Triton kernel, and the
tree-serial baseline with and without ``state_indices``.

    python bench/tuning/ab_kernels.py --base .run/tv_base.py --batches 1 16 --rounds 5 --tag=-x
    python bench/tuning/ab_kernels.py --plot bench/results/ab-kernels-DATE-TAG.json   # redraw the plot
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# Run by path, Python puts bench/tuning/ first on sys.path: drop it, so that bench's modules are
# reached as bench.<name> and never shadow, or are shadowed by, an installed package of that name.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench" / "tuning")]

from bench import harness as kb  # noqa: E402

from bole.config import gdn_shape  # noqa: E402


def load_module(path: str, name: str):
    """The Python file ``path`` imported as module ``name`` (its own Triton kernels)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def plot(path: Path) -> Path:
    """Bars of each timed call's median per batch (microseconds, log scale), rounds as dots."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    meds = [r for r in data["records"] if r["what"].endswith("-median")]
    batches = sorted({r["batch"] for r in meds})
    names = list(dict.fromkeys(r["what"][:-len("-median")] for r in meds))
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(names) * len(batches) / 2, 4.2))
    width = 0.8 / len(batches)
    for i, b in enumerate(batches):
        rows = {r["what"][:-len("-median")]: r for r in meds if r["batch"] == b}
        xs = [j + i * width for j in range(len(names))]
        ax.bar(xs, [rows[n]["us"] for n in names], width, label=f"batch {b}")
        for x, n in zip(xs, names):
            ax.plot([x] * len(rows[n]["rounds"]), rows[n]["rounds"], "k.", ms=3)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))])
    ax.set_xticklabels(names, rotation=25, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("median us per call")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=7)
    m = data["meta"]
    ax.set_title(f"{m['model']} T = {m['nodes']}: {kb.run_label(m)}; base = {m.get('base')}",
                 fontsize=7)
    return kb.save_png(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--base", default=None,
                    help="a copy of bole/ops/gdn/verify/kernel.py to time against the tree's (none: the tree's "
                         "kernel and the launch overheads only)")
    ap.add_argument("--model", default="qwen3.5-9b")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    kb.add_output_args(ap)
    args = ap.parse_args(argv)
    if args.plot:
        print(plot(Path(args.plot)))
        return 0
    if not torch.cuda.is_available():
        print("ab_kernels needs a CUDA device")
        return 0

    import triton
    import triton.language as tl

    from bole.ops.gdn.verify import kernel as tv

    @triton.jit
    def _empty(x_ptr):
        if tl.program_id(0) < 0:
            tl.store(x_ptr, 0.0)

    mods = {"tree": tv}
    if args.base:
        mods["base"] = load_module(args.base, "bole_ab_base_triton_verify")
    dev = torch.device("cuda")
    meta = kb.run_meta(model=args.model, nodes=args.nodes, depth=kb.DEPTH, base=args.base,
                       timing="CUDA graph replay over rotating input sets, median per call")
    shape = gdn_shape(args.model)
    Hv, dk, dv = shape.num_v_heads, shape.head_k_dim, shape.head_v_dim
    dummy = torch.zeros(1, device=dev)
    records = []
    for batch in args.batches:
        forest, fmeta = kb.bench_forest(args.nodes, batch, batch * 1000 + args.nodes, dev)
        R = forest.num_requests
        sets = kb.rotating_sets(shape, forest, dev, seed=args.nodes * 7 + batch)
        snaps = torch.empty(forest.num_nodes * Hv * dk * dv, device=dev, dtype=torch.float32)
        ref, _ = kb.reference_fp64(sets[0], forest)
        picked = tv.pick_config(fmeta.block_nodes, dk, dv, R * Hv)

        def verify(mod, x, idx):
            return kb.verify_inputs(x, fmeta, impl=mod.tree_gdn_verify_triton, state_indices=idx,
                                    config=mod.VerifyConfig(**vars(picked)))

        def serial(x, idx):
            return kb.serial_inputs(x, fmeta, snaps, state_indices=idx, **kb.SERIAL_BEST)

        calls = {}
        for name, mod in mods.items():
            o, _ = verify(mod, sets[0], sets[0]["slots"])
            err = kb.rel_err(o, ref)
            records.append(dict(batch=batch, what=f"rel_err-{name}", value=err))
            print(f"batch {batch} {name}: rel_err {err:.2e}", flush=True)
            calls[f"verify-{name}"] = [lambda x=x, mod=mod: verify(mod, x, x["slots"])
                                       for x in sets]
        calls["verify-tree-default-indices"] = [lambda x=x: verify(tv, x, None) for x in sets]
        calls["arange"] = [lambda: torch.arange(R, dtype=torch.int32, device=dev)] * len(sets)
        calls["empty-kernel"] = [lambda: _empty[(128,)](dummy)] * len(sets)
        calls["tree-serial"] = [lambda x=x: serial(x, x["slots"]) for x in sets]
        calls["tree-serial-default-indices"] = [lambda x=x: serial(x, None) for x in sets]
        names = list(calls)
        for rnd in range(args.rounds):
            order = names if rnd % 2 == 0 else names[::-1]
            for name in order:
                us = kb.time_calls(calls[name])
                records.append(dict(batch=batch, what=name, round=rnd, us=us))
        for name in names:
            vals = [r["us"] for r in records if r["batch"] == batch and r["what"] == name]
            records.append(dict(batch=batch, what=f"{name}-median", us=statistics.median(vals),
                                rounds=vals))
            print(f"batch {batch} {name:32s} median {statistics.median(vals):8.2f} us  "
                  f"rounds {' '.join(f'{v:.2f}' for v in vals)}", flush=True)
        sets = snaps = None
        torch.cuda.empty_cache()
    path = kb.results_path(args.out, f"ab-kernels-{meta['date']}{args.tag}.json")
    path.write_text(json.dumps(dict(meta=meta, config="pick_config", records=records), indent=1))
    print(f"wrote {path} and {plot(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
