"""`bole serve`: one process, or under ``--tp N`` rank 0 serving in this process and ranks
1..N-1 spawned as followers that step in lockstep with it (bole/engine/lockstep.py), or under
``--replicas N`` N engines as Ray Serve replicas (bole/server/replicas.py)."""

from __future__ import annotations

import os
from pathlib import Path

from bole.assets import BUNDLED_MODEL
from bole.cli.common import (UsageError, check_positive, checkpoint_folder, load_tokenizer,
                             pick_device, prefix_cache_from_args, set_rank_device,
                             spec_from_args)
from bole.cli.parser import build_parser
from bole.speculative.drafters.registry import FALLBACK_DRAFTER

__all__ = ["serve", "serve_tp", "serve_replicas", "replica_app"]


def _serve_checks(args) -> Path:
    """serve's arguments checked, nothing loaded; the checkpoint folder."""
    from bole.models.config import HybridConfig
    check_positive(max_batch=args.max_batch, max_queue=args.max_queue, max_len=args.max_len,
              max_prompt_bytes=args.max_prompt_bytes)
    if args.shutdown_timeout < 0:
        raise UsageError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.api_key is None:
        args.api_key = os.environ.get("BOLE_API_KEY") or None
    elif not args.api_key:
        raise UsageError("--api-key is empty (an unset variable?): pass a key, or leave the flag "
                         "out to serve without one")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must lie in 1..65535, got {args.port}")
    pick_device(args.device)
    folder = checkpoint_folder(args.model, need_tokenizer=True)
    spec_from_args(args, args.drafter or FALLBACK_DRAFTER)
    context = HybridConfig.from_pretrained(folder).max_position_embeddings
    if args.max_len > context:
        raise UsageError(f"--max-len {args.max_len} exceeds the model's context of {context}")
    return folder


def _serve_engine(args, folder: Path, tp=None):
    """The engine ``bole serve`` runs (this rank's shard under tensor parallelism, ``tp``)."""
    import torch

    from bole.engine import Engine, default_drafter
    from bole.models.qwen3_hybrid import HybridModel
    tokenizer = load_tokenizer(folder)
    device = pick_device(args.device)
    default = torch.bfloat16 if device.startswith("cuda") else torch.float32
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(
        getattr(args, "dtype", None), default)
    model = HybridModel.from_pretrained(folder, dtype=dtype, device=device, tp=tp)
    spec = spec_from_args(args, args.drafter or default_drafter(model))
    engine = Engine(model, spec, max_slots=args.max_batch, max_len=args.max_len,
                    tokenizer=tokenizer, progress=True,
                    prefix_cache=prefix_cache_from_args(args))
    if device.startswith("cuda"):             # compile the admission path before any request
        engine.warm_up()
    return engine


def _serve_server(args, folder: Path, engine, channel=None, client=None):
    from bole.server.api import BoleServer, ServerConfig
    from bole.server.chat import ChatTemplate
    name = args.name or ("bundled" if folder.resolve() == BUNDLED_MODEL.resolve() else folder.name)
    config = ServerConfig(max_prompt_bytes=args.max_prompt_bytes, api_key=args.api_key,
                          shutdown_timeout=args.shutdown_timeout)
    return BoleServer(engine, name, max_queue=args.max_queue, max_batch=args.max_batch,
                      chat_template=ChatTemplate.for_checkpoint(folder), channel=channel,
                      client=client, tokenizer=load_tokenizer(folder) if client else None,
                      config=config)


def serve(args) -> int:
    import logging
    import signal

    from bole.server.api import serve as run_server

    if getattr(args, "replicas", None) is not None:
        return serve_replicas(args)
    folder = _serve_checks(args)
    logging.basicConfig(level=logging.INFO, format="[bole] %(message)s")
    signal.signal(signal.SIGTERM, _interrupt)           # shut down in order on SIGTERM too
    if not args.engine_process:
        run_server(_serve_server(args, folder, _serve_engine(args, folder)), args.host,
                   args.port, access_log=args.access_log)
        return 0
    from bole.server.engine_process import EngineClient
    try:
        client = EngineClient(_serve_engine, (args, folder), max_queue=args.max_queue)
    except RuntimeError as exc:                   # the engine process's build failed
        raise UsageError(str(exc)) from None
    try:
        run_server(_serve_server(args, folder, None, client=client), args.host, args.port,
                   alive=client.healthy, access_log=args.access_log)
    finally:
        client.stop()
    return 0


def serve_tp(args, argv: list[str]) -> int:
    """``serve --tp N``: rank 0 in this process (HTTP, scheduler), ranks 1..N-1 spawned as
    followers that step in lockstep with it; they stop when it does, and die with it."""
    import logging
    import signal

    import torch.multiprocessing as mp

    from bole import distributed
    from bole.server.api import serve as run_server
    from bole.engine.lockstep import Channel

    if getattr(args, "replicas", None) is not None:
        return serve_replicas(args)
    folder = _serve_checks(args)
    logging.basicConfig(level=logging.INFO, format="[bole] %(message)s")
    port = distributed.free_port()
    followers = mp.spawn(_serve_follower, args=(args.tp, port, argv), nprocs=args.tp - 1,
                         join=False, daemon=True)
    signal.signal(signal.SIGTERM, _interrupt)           # shut down in order on SIGTERM too
    channel = None
    try:
        set_rank_device(args, 0)
        tp = distributed.init(0, args.tp, port, args.device or "cpu")
        channel = Channel(tp)
        server = _serve_server(args, folder, _serve_engine(args, folder, tp), channel)
        run_server(server, args.host, args.port,
                   alive=lambda: all(p.is_alive() for p in followers.processes),
                   access_log=args.access_log)
    finally:
        if channel is not None:
            channel.close()                             # a no-op once the engine loop sent it
        _stop_followers(followers.processes, timeout=30 if channel is not None else 0)
        distributed.shutdown()
    return 0


def _replica_plan(args, folder: Path):
    """``--replicas``: the replicas' options and the Ray cluster they run on."""
    import logging

    import torch

    from bole.server.replicas import RayCluster, RayMissing, ReplicaOptions, require_ray
    check_positive(replicas=args.replicas, replica_cpus=args.replica_cpus)
    try:
        require_ray()
    except RayMissing as exc:
        raise UsageError(str(exc)) from None
    cuda = pick_device(args.device).startswith("cuda")
    cores = os.cpu_count() or 1
    tp = getattr(args, "tp", 1)
    if cuda and args.replica_cpus is not None:
        raise UsageError("--replica-cpus is for replicas on the CPU; on CUDA each replica has "
                         "GPUs of its own")
    if cuda and args.ray_address is None and torch.cuda.device_count() < args.replicas * tp:
        raise UsageError(f"--replicas {args.replicas} x --tp {tp} needs {args.replicas * tp} "
                         f"GPUs, this machine has {torch.cuda.device_count()} (--ray-address "
                         "deploys on a cluster)")
    cpus = 1 if cuda else args.replica_cpus or max(1, cores // args.replicas)
    if not cuda and args.ray_address is None and cpus * args.replicas > cores:
        logging.getLogger("bole.server").warning(
            "%d replicas x %d cores is more than this machine's %d cores: they will contend",
            args.replicas, cpus, cores)
    options = ReplicaOptions(args.replicas, num_cpus=cpus, num_gpus=tp if cuda else 0,
                             max_ongoing_requests=args.max_batch,
                             max_queued_requests=args.max_queue,
                             shutdown_timeout=args.shutdown_timeout,
                             access_log=args.access_log)
    if cuda:
        args.device = "cuda"             # a replica sees only its own GPUs, from cuda:0
    if args.ray_address is not None:
        _check_reachable(args.ray_address)
    cluster = RayCluster(args.ray_address, num_cpus=max(cores, cpus * args.replicas)
                         if args.ray_address is None else None)
    return options, cluster


def _check_reachable(address: str) -> None:
    """A ``host:port`` --ray-address answers a TCP connection within 5 s (else ray.init retries
    for minutes, deaf to Ctrl-C)."""
    import socket
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return                                # "auto", or a ray:// client address
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as exc:
        raise UsageError(f"--ray-address {address}: no Ray cluster answers there ({exc}); "
                         "start one with 'ray start --head'") from None


def _replica_server(args, folder: Path):
    """A replica's server (run in the replica's process): engine, scheduler, app state; under
    ``--tp N`` rank 0, ranks 1..N-1 spawned as followers (they die with this process)."""
    if getattr(args, "tp", 1) > 1:
        return _replica_tp_server(args, folder)
    if not args.engine_process:
        return _serve_server(args, folder, _serve_engine(args, folder))
    from bole.server.engine_process import EngineClient
    client = EngineClient(_serve_engine, (args, folder), max_queue=args.max_queue)
    return _serve_server(args, folder, None, client=client)


def _replica_tp_server(args, folder: Path):
    import torch.multiprocessing as mp

    from bole import distributed
    from bole.engine.lockstep import Channel
    from bole.server.replicas import ReplicaServer
    port = distributed.free_port()
    followers = mp.spawn(_follower, args=(args.tp, port, args, folder), nprocs=args.tp - 1,
                         join=False, daemon=True).processes
    set_rank_device(args, 0)
    tp = distributed.init(0, args.tp, port, args.device or "cpu")
    server = _serve_server(args, folder, _serve_engine(args, folder, tp), Channel(tp))
    return ReplicaServer(server, alive=lambda: all(p.is_alive() for p in followers))


def replica_app(argv: list[str]):
    """The Ray Serve application that ``bole serve ARGV --replicas N`` runs, for ``serve.run``
    on a Ray cluster of your own (docs/multi-node.md)."""
    from bole.server.replicas import replica_app as build_app
    args = build_parser().parse_args(["serve", *argv])
    if args.replicas is None:
        raise UsageError("replica_app needs --replicas N")
    folder = _serve_checks(args)
    options, _ = _replica_plan(args, folder)
    return build_app(options, _replica_server, (args, folder), args.api_key)


def serve_replicas(args) -> int:
    """``serve --replicas N``: N engines as Ray Serve replicas behind Serve's HTTP proxy on
    ``--host:--port``, until SIGINT or SIGTERM (then every replica and Ray process stops)."""
    import logging
    import signal

    from bole.server.replicas import DeployFailed, serve_replicas as run_replicas
    folder = _serve_checks(args)
    options, cluster = _replica_plan(args, folder)
    logging.basicConfig(level=logging.INFO, format="[bole] %(message)s")
    if not args.api_key and args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("bole.server").warning(
            "serving on %s without an API key: anyone who can reach this address can use the "
            "model (pass --api-key or set BOLE_API_KEY)", args.host)
    signal.signal(signal.SIGTERM, _interrupt)           # until Ray starts: then its own
    try:
        run_replicas(options, _replica_server, (args, folder), cluster, args.host, args.port,
                     api_key=args.api_key)
    except ConnectionError as exc:                      # no Ray cluster at --ray-address
        raise UsageError(f"--ray-address {args.ray_address}: {exc}") from None
    except DeployFailed as exc:
        raise UsageError(str(exc)) from None
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _stop_followers(processes, timeout: float) -> None:
    """Join the follower processes (``timeout`` seconds in all), then end any still running."""
    import time
    deadline = time.monotonic() + timeout
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.terminate()
            p.join(5)
        if p.is_alive():
            p.kill()
            p.join()


def _serve_follower(i: int, world: int, port: int, argv: list[str]) -> None:
    """Rank ``i + 1`` of ``serve --tp``: silent, binds no port, steps as rank 0 says until it
    stops; ignores Ctrl-C (rank 0 stops it) and dies with rank 0's process."""
    _follower(i, world, port, build_parser().parse_args(argv), None)


def _follower(i: int, world: int, port: int, args, folder: Path | None) -> None:
    """Rank ``i + 1`` of ``args`` (``folder``: the checkpoint's, None: ``args.model``)."""
    import signal

    from bole import distributed
    from bole.engine.lockstep import Channel, LockstepScheduler
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    distributed.die_with_parent()
    rank = i + 1
    set_rank_device(args, rank)
    tp = distributed.init(rank, world, port, args.device or "cpu")
    try:
        channel = Channel(tp)
        with distributed.quiet_unless_rank0(rank):
            engine = _serve_engine(args, folder or Path(args.model), tp)
            LockstepScheduler(engine, channel, max_queue=args.max_queue).follow()
    finally:
        distributed.shutdown()
