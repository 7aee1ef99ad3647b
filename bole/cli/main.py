"""The ``bole`` command line: demo, generate, bench, serve, calibrate (and bench-serve).

Arguments are checked before anything is loaded; every failure a user can cause ends with exit
code 2 and one line naming the problem and what to do (never a traceback).
"""

from __future__ import annotations

import sys

from bole.assets import BUNDLED_MODEL
from bole.cli.bench import bench
from bole.cli.common import (UsageError, check_positive, checkpoint_folder, load_model,
                             load_tokenizer, pick_device, read_prompt, set_rank_device,
                             spec_from_args)
from bole.cli.generate import generate
from bole.cli.parser import build_parser
from bole.speculative.drafters.registry import FALLBACK_DRAFTER


def _demo(args) -> int:
    from bole import demo, generation_demo
    if any(n < 1 for n in args.nodes) or args.depth < 0 or args.max_tokens < 1:
        raise UsageError("--nodes and --max-tokens must be >= 1 and --depth >= 0")
    if not args.no_generate:
        folder = checkpoint_folder(args.model, need_tokenizer=True)
        load_tokenizer(folder)
        generation_demo.run(folder, read_prompt(args), args.max_tokens)
    demo.main(args.shape, tuple(args.nodes), args.depth, args.seed)
    return 0


def _calibrate(args) -> int:
    import torch

    from bole.engine.calibrate import calibrate_model
    from bole.speculative.budget.widths import spread_width

    for b in args.batches:
        check_positive(batches=b)
    check_positive(context=args.context, reps=args.reps)
    if args.eps < 0:
        raise UsageError(f"--eps must be >= 0, got {args.eps}")
    device = pick_device(args.device)
    args.mode = "bole"
    spec = spec_from_args(args, FALLBACK_DRAFTER)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model, _, _ = load_model(args, device, dtype)
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
    args = build_parser().parse_args(argv)
    set_rank_device(args, rank)
    args.tp_group = distributed.init(rank, world, port, args.device or "cpu")
    try:
        with distributed.quiet_unless_rank0(rank):
            rc = {"generate": generate, "bench": bench}[args.command](args)
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
    device = pick_device(args.device)
    if device.startswith("cuda") and torch.cuda.device_count() < args.tp:
        raise UsageError(f"--tp {args.tp} needs {args.tp} GPUs, this machine has "
                         f"{torch.cuda.device_count()}")
    from bole.models.config import HybridConfig
    from bole.models.sharding import check_divisible
    if getattr(args, "preset", None):
        from bole.models.presets import preset_config
        check_divisible(preset_config(args.preset), args.tp)
    else:
        check_divisible(HybridConfig.from_pretrained(checkpoint_folder(
            args.model or str(BUNDLED_MODEL), need_tokenizer=False)), args.tp)
    if args.command == "serve":
        if args.engine_process:
            raise UsageError("--engine-process runs one engine process: not with --tp")
        from bole.cli.serve import serve_tp
        return serve_tp(args, argv)
    mp.spawn(_tp_worker, args=(args.tp, free_port(), argv), nprocs=args.tp, join=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if getattr(args, "tp", 1) != 1:
        try:
            return _run_tp(args, argv)
        except (UsageError, ValueError, FileNotFoundError) as exc:
            print(f"bole {args.command}: {exc}", file=sys.stderr)
            return 2
    from bole.cli.serve import serve
    commands = {"demo": _demo, "generate": generate, "bench": bench, "serve": serve,
                "calibrate": _calibrate}
    if args.command == "bench-serve":
        from bole.bench.loadgen import main as bench_serve
        return bench_serve(args)
    command = commands[args.command]
    try:
        return command(args)
    except (UsageError, ValueError, FileNotFoundError) as exc:
        print(f"bole {args.command}: {exc}", file=sys.stderr)
        return 2

