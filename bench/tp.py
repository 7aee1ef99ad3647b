"""Tensor parallelism at real shapes: forward latency and all-reduce time at each tp size.

For a preset (default Qwen3.5-27B, bf16, random weights) with every request at --context
committed tokens, at each ``--tp-sizes`` entry (one process per rank, NCCL on GPUs, gloo on the
CPU, ``bole.distributed``) and each batch of ``--batches``:

  decode        one token per request, GDN in place (as ar runs it)
  verify-T      one T-node random tree per request (T = --nodes, depth 8): bole's verify forward

each captured in a CUDA graph on the GPU (collectives inside the graph, as SGLang captures them;
eager on the CPU), timed by device events over replays on rank 0. The all-reduce share: the
forward's all-reduces counted during one eager call, then the same number of all-reduces of its
``[N, H]`` activations captured and timed alone. Each rank's NVLink multicast stays off
(``bole.distributed``'s environment). Records ``{tp, batch, case, nodes, total_ms,
allreduce_ms, allreduces, captured}``; the summary has each case's tp-N / tp-1 ratio, and the
issue's target (27B batch 1 verify-64 at tp 2 <= 0.6x tp 1). End-to-end tokens/s at each tp come
from ``bench/e2e.py --tp N`` (same presets, the replay drafter).

    python bench/tp.py                                   # 2 GPUs: tp 1 and 2 -> bench/results/tp-<date>.{json,png}
    python bench/tp.py --device cpu --dtype fp32 --preset tiny --context 64 --batches 1 2 \\
        --nodes 8 --reps 2 --out /tmp/tp-smoke              # CPU smoke run (gloo)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
# Run by path, Python puts bench/ first on sys.path: drop it, so that bench's modules are reached
# as bench.<name> and can never shadow, or be shadowed by, an installed package of the same name.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench")]
from bole import distributed  # noqa: E402
from bole.engine.calibrate import captured_ms  # noqa: E402
from bole.engine.runner import ModelRunner  # noqa: E402
from bole.forest import DenseForest  # noqa: E402
from bole.models.presets import preset_config  # noqa: E402
from bole.models.qwen3_hybrid import HybridModel  # noqa: E402
from bole.models.sharding import check_divisible  # noqa: E402
from bole.tree import DraftTree, PackedForest  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: the issue's target: 27B batch-1 verify-64 at tp 2 within this share of tp 1
TARGET_VERIFY_RATIO = 0.6


def count_allreduces(model: HybridModel, fn) -> list[tuple[int, ...]]:
    """The shapes of the all-reduces one eager call of ``fn`` makes."""
    shapes: list[tuple[int, ...]] = []
    inner = model.tp.all_reduce

    def counting(x):
        shapes.append(tuple(x.shape))
        return inner(x)
    model.tp.all_reduce = counting
    try:
        fn()
    finally:
        model.tp.all_reduce = inner
    return shapes


def measure(args, tp=None) -> list[dict]:
    """This rank's part of the study at one tp size (rank 0's records are returned)."""
    rank = 0 if tp is None else tp.rank
    world = 1 if tp is None else tp.world
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    model = HybridModel.random(preset_config(args.preset), dtype=DTYPES[args.dtype],
                               device=device, tp=tp)
    B = max(args.batches)
    T = max(args.nodes)
    runner = ModelRunner(model, model.new_cache(B, args.context + T + 2),
                         "triton" if device.type == "cuda" else "torch")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (args.context,), generator=gen)
    slots = [runner.cache.allocate(args.context + T + 2) for _ in range(B)]
    runner.prefill(slots[0], prompt)
    for s in slots[1:]:                          # the same committed context in every slot
        runner.cache.copy_slot(slots[0], s)
    rng = np.random.default_rng(0)
    decode_gdn = "triton-decode" if device.type == "cuda" else "torch-decode"
    records = []
    for batch in args.batches:
        slot_t = torch.tensor(slots[:batch], dtype=torch.int32, device=device)
        cases = [("decode", DenseForest.chain(batch, 1, device), decode_gdn)]
        for n in args.nodes:
            trees = [DraftTree.random(n, min(8, n - 1), rng) for _ in range(batch)]
            cases.append((f"verify-{n}", DenseForest.from_packed(PackedForest.pack(trees),
                                                                 device=device), None))
        for name, dense, gdn in cases:
            tokens = torch.randint(0, model.config.vocab_size, (dense.num_nodes,),
                                   generator=gen).to(device)

            def forward():
                forest = DenseForest.from_parents(dense.parents, dense.valid, dense.max_depth)
                runner.forward(runner.make_batch(tokens, forest, slot_t, gdn))
            shapes = count_allreduces(model, forward)
            total = captured_ms(forward, device, args.reps)
            reduce_ms = 0.0
            if world > 1 and shapes:
                bufs = [torch.randn(s, dtype=model.dtype, device=device) for s in set(shapes)]
                by_shape = {tuple(b.shape): b for b in bufs}

                def reduces():
                    for s in shapes:
                        model.tp.all_reduce(by_shape[s])
                reduce_ms = captured_ms(reduces, device, args.reps)
            records.append(dict(tp=world, batch=batch, case=name, nodes=dense.num_nodes,
                                total_ms=total, allreduce_ms=reduce_ms, allreduces=len(shapes),
                                captured=device.type == "cuda"))
            if rank == 0:
                print(f"[tp] tp {world} batch {batch} {name}: {total:.3f} ms, all-reduce "
                      f"{reduce_ms:.3f} ms ({len(shapes)} calls)", flush=True)
    return records


def rank_main(rank: int, args, world: int, port: int, out: str) -> None:
    tp = distributed.init(rank, world, port, args.device)
    try:
        with distributed.quiet_unless_rank0(rank):
            records = measure(args, tp)
        if rank == 0:
            Path(out).write_text(json.dumps(records))
    finally:
        distributed.shutdown(meet=True)


def run_size(args, world: int, out_dir: Path) -> list[dict]:
    """The study at one tp size: in this process for tp 1, else one spawned process per rank."""
    if world == 1:
        records = measure(args)
        if args.device == "cuda":                 # the spawned ranks need the memory back
            torch.cuda.empty_cache()
        return records
    part = out_dir / f".tp-{world}-records.json"
    mp.spawn(rank_main, args=(args, world, distributed.free_port(), str(part)), nprocs=world,
             join=True)
    records = json.loads(part.read_text())
    part.unlink()
    return records


def summarise(records: list[dict]) -> dict:
    """Each (batch, case)'s time at every tp size over its tp-1 time, and the issue's target."""
    base = {(r["batch"], r["case"]): r["total_ms"] for r in records if r["tp"] == 1}
    ratios = {f"tp{r['tp']}/b{r['batch']}/{r['case']}": r["total_ms"] / base[r["batch"], r["case"]]
              for r in records if r["tp"] > 1 and (r["batch"], r["case"]) in base}
    key = "tp2/b1/verify-64"
    return dict(ratios=ratios, target=dict(case=key, max_ratio=TARGET_VERIFY_RATIO,
                                           ratio=ratios.get(key),
                                           met=None if key not in ratios else
                                           ratios[key] <= TARGET_VERIFY_RATIO))


def plot(path: Path, records: list[dict]) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = sorted({r["case"] for r in records}, key=lambda c: (c != "decode", c))
    sizes = sorted({r["tp"] for r in records})
    fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4), squeeze=False)
    for ax, case in zip(axes[0], cases):
        for world in sizes:
            rs = sorted((r for r in records if r["case"] == case and r["tp"] == world),
                        key=lambda r: r["batch"])
            ax.plot([r["batch"] for r in rs], [r["total_ms"] for r in rs], marker="o",
                    label=f"tp {world}")
            if world > 1:
                ax.plot([r["batch"] for r in rs], [r["allreduce_ms"] for r in rs], ls="--",
                        marker="x", label=f"tp {world}: all-reduces alone")
        ax.set(title=case, xlabel="batch", ylabel="ms", xscale="log")
        ax.legend()
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=120)
    return png


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--preset", default="qwen3.5-27b")
    ap.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--nodes", type=int, nargs="+", default=[64], help="verify tree sizes")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"))
    ap.add_argument("--tag", default="", help="suffix of the result files' names")
    args = ap.parse_args(argv)
    config = preset_config(args.preset)
    for world in args.tp_sizes:
        if world < 1:
            ap.error(f"--tp-sizes must be >= 1, got {world}")
        try:
            check_divisible(config, world)
        except ValueError as exc:
            ap.error(str(exc))
        if args.device == "cuda" and torch.cuda.device_count() < world:
            ap.error(f"tp {world} needs {world} GPUs, this machine has "
                     f"{torch.cuda.device_count()}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for world in args.tp_sizes:
        records += run_size(args, world, out)
    import triton
    meta = dict(date=dt.date.today().isoformat(), preset=args.preset, dtype=args.dtype,
                context=args.context, device=(torch.cuda.get_device_name(0)
                                              if args.device == "cuda" else "cpu"),
                torch=torch.__version__, triton=triton.__version__, reps=args.reps,
                nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"))
    data = dict(meta=meta, records=records, summary=summarise(records))
    path = out / f"tp-{meta['date']}-{args.preset}{args.tag}.json"
    path.write_text(json.dumps(data, indent=1))
    png = plot(path, records)
    print(json.dumps(data["summary"], indent=1))
    print(f"wrote {path} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
