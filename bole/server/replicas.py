"""Bole engines as Ray Serve replicas (``bole serve --replicas N``; ``pip install "bole[ray]"``).

Each replica is one Ray actor running one engine and the unchanged FastAPI app of
:func:`bole.server.api.create_app` (every OpenAI route, SSE streaming included), wrapped with
``@serve.ingress``; Ray Serve's HTTP proxy takes the requests and its request router picks a
replica for each: the default power-of-two-choices router, which probes two replicas and sends
the request to the one with fewer requests in flight (the least loaded by queue length). A
replica takes at most ``max_ongoing_requests`` requests at once (the engine's batch): the rest
wait at the proxy (up to ``max_queued_requests``, then 503), so that a request reaches a replica
only when it can join the batch, and a replica that dies takes with it only the requests it was
running (those waiting at the proxy go to the other replicas).

``GET /metrics`` answers for every replica (:mod:`bole.server.replica_metrics`: summed, or with
``?by=replica`` labelled per replica), gathered by a broadcast to the replicas. Ray Serve checks
each replica's engine thread and tensor-parallel ranks (``check_health``) and replaces a replica
that failed or died. :class:`RayCluster` starts a Ray instance of its own or joins a cluster.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger("bole.server")

__all__ = ["RAY_EXTRA", "DeployFailed", "RayMissing", "ReplicaOptions", "ReplicaServer", "BoleReplica",
           "RayCluster", "replica_app", "require_ray", "serve_replicas"]

#: how to install what ``--replicas`` needs
RAY_EXTRA = 'pip install "bole[ray]"'
#: seconds a /metrics page waits for the replicas' pages
METRICS_TIMEOUT_S = 5.0


class RayMissing(RuntimeError):
    """Ray Serve is not installed."""


class DeployFailed(RuntimeError):
    """The replicas did not start (their errors are in the log, from Ray)."""


def require_ray() -> None:
    """Raise :class:`RayMissing` (one line naming the extra) unless Ray Serve imports."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        raise RayMissing(f"--replicas needs Ray Serve, which is not installed ({exc.name}): "
                         f"{RAY_EXTRA}") from None


@dataclass
class ReplicaOptions:
    """How the replicas are deployed. ``num_gpus`` / ``num_cpus``: Ray resources each replica
    reserves (a GPU per tensor-parallel rank on CUDA, CPU cores on the CPU);
    ``max_ongoing_requests``: requests a replica takes at once (its engine's batch);
    ``max_queued_requests``: requests waiting at the proxy for a replica before new ones get 503;
    ``shutdown_timeout``: seconds a stopping replica lets its requests finish;
    ``health_check_period_s``: how often Ray Serve asks a replica whether its engine runs;
    ``access_log``: Ray Serve's log line per request."""

    replicas: int
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_ongoing_requests: int = 16
    max_queued_requests: int = 256
    shutdown_timeout: float = 30.0
    health_check_period_s: float = 2.0
    access_log: bool = False
    name: str = "bole"

    def __post_init__(self):
        for name in ("replicas", "max_ongoing_requests", "max_queued_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_cpus <= 0 or self.num_gpus < 0:
            raise ValueError(f"a replica needs num_cpus > 0 and num_gpus >= 0, got "
                             f"{self.num_cpus} and {self.num_gpus}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")

    def deployment_options(self) -> dict[str, Any]:
        """The keyword arguments of ``serve.deployment``."""
        return dict(name=self.name, num_replicas=self.replicas,
                    ray_actor_options={"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
                    max_ongoing_requests=self.max_ongoing_requests,
                    max_queued_requests=self.max_queued_requests,
                    graceful_shutdown_timeout_s=self.shutdown_timeout,
                    health_check_period_s=self.health_check_period_s,
                    logging_config={"enable_access_log": self.access_log})


@dataclass
class ReplicaServer:
    """What a replica's build returns when the replica has processes besides its own
    (tensor-parallel ranks): the server, and whether those processes still run."""

    server: Any
    alive: Callable[[], bool] | None = None


class BoleReplica:
    """One replica: ``build(*build_args)`` makes its :class:`~bole.server.api.BoleServer`
    (engine included; or a :class:`ReplicaServer`) in the replica's process; Ray Serve then
    serves the server's app."""

    def __init__(self, build: Callable[..., Any], build_args: tuple = (),
                 num_threads: int | None = None):
        """``num_threads``: torch's CPU threads in this replica (None: torch's default)."""
        from bole.server.api import GIL_SWITCH_INTERVAL
        logging.basicConfig(level=logging.INFO, format="[bole replica] %(message)s")
        if num_threads:
            import torch
            torch.set_num_threads(num_threads)
        sys.setswitchinterval(GIL_SWITCH_INTERVAL)
        built = build(*build_args)
        if not isinstance(built, ReplicaServer):
            built = ReplicaServer(built)
        self.server, self.others_alive = built.server, built.alive

    def __serve_build_asgi_app__(self):
        """The server's app, its /metrics answering for every replica."""
        from fastapi.responses import Response

        from bole.server.api import create_app
        app = create_app(self.server)
        app.router.routes[:] = [r for r in app.router.routes
                                if getattr(r, "path", None) != "/metrics"]

        @app.get("/metrics")
        async def metrics(by: str = ""):
            return Response(await self.all_metrics(by == "replica"),
                            media_type="text/plain; version=0.0.4")
        return app

    def check_health(self) -> None:
        """Ray Serve's health check: an engine thread that stopped on an error, or a
        tensor-parallel rank that exited, fails it (Ray Serve then replaces this replica)."""
        if not self.server.loop.healthy():
            raise RuntimeError("the engine stopped")
        if self.others_alive is not None and not self.others_alive():
            raise RuntimeError("a tensor-parallel rank exited")

    def replica_metrics(self) -> tuple[str, bytes]:
        """This replica's id and its /metrics page (called on every replica by a broadcast)."""
        from ray import serve
        return serve.get_replica_context().replica_id.unique_id, self.server.metrics.render()

    async def all_metrics(self, by_replica: bool) -> bytes:
        """Every replica's metrics merged (those that answer within METRICS_TIMEOUT_S)."""
        from ray import serve

        from bole.server.replica_metrics import merge_metrics
        ctx = serve.get_replica_context()
        handle = serve.get_deployment_handle(ctx.deployment, ctx.app_name)
        try:
            results = await handle.broadcast("replica_metrics").results_async(
                timeout_s=METRICS_TIMEOUT_S, return_exceptions=True)
        except TimeoutError:
            results = []
        pages = dict(r for r in results if isinstance(r, tuple))
        if not pages:                                   # at least this replica's own
            pages = dict([self.replica_metrics()])
        return merge_metrics(pages, by_replica)


def replica_app(options: ReplicaOptions, build: Callable[..., Any], build_args: tuple = ()):
    """The Ray Serve application of ``options.replicas`` replicas, each serving
    ``build(*build_args)`` (a :class:`~bole.server.api.BoleServer`); ``serve.run`` it."""
    require_ray()
    from ray import serve
    threads = None if options.num_gpus else max(1, int(options.num_cpus))
    deployment = serve.deployment(**options.deployment_options())(serve.ingress()(BoleReplica))
    return deployment.bind(build, build_args, threads)


@dataclass
class RayCluster:
    """Where the replicas run: ``address`` None starts a Ray instance on this machine with
    ``num_cpus`` and ``num_gpus`` (None: all it has), else joins that cluster (``"auto"``: the
    one ``ray start`` began here)."""

    address: str | None = None
    num_cpus: int | None = None
    num_gpus: int | None = None
    _before: set = field(default_factory=set, repr=False)   # processes that were not Ray's

    def start(self, host: str, port: int) -> None:
        """Ray, then Serve's HTTP proxy on ``host:port``."""
        import ray
        import psutil                       # Ray's own copy (ray/thirdparty_files)
        from ray import serve
        self._before = {p.pid for p in psutil.Process().children(recursive=True)}
        if self.address is None:
            ray.init(address="local", num_cpus=self.num_cpus, num_gpus=self.num_gpus,
                     include_dashboard=False, log_to_driver=True)
        else:
            ray.init(address=self.address, log_to_driver=True)
        serve.start(http_options={"host": host, "port": port})

    def stop(self, app_name: str) -> None:
        """A cluster of our own: Serve and Ray shut down (every replica and proxy stops, then
        every Ray process); a cluster joined: only our application deleted."""
        import ray
        import psutil                       # Ray's own copy (ray/thirdparty_files)
        from ray import serve
        if not ray.is_initialized():
            return
        ours = [p for p in psutil.Process().children(recursive=True)
                if p.pid not in self._before] if self.address is None else []
        try:
            if self.address is None:
                serve.shutdown()
            else:
                serve.delete(app_name)
        finally:
            ray.shutdown()
            _end(ours)


def _end(processes: list, grace: float = 5.0) -> None:
    """Wait up to ``grace`` s for these processes to exit, then end the rest (Ray's agents
    outlive ``ray.shutdown()``: they see the raylet gone but do not exit)."""
    import ray  # noqa: F401  (puts Ray's psutil on the path)
    import psutil
    _, alive = psutil.wait_procs(processes, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)


def serve_replicas(options: ReplicaOptions, build: Callable[..., Any], build_args: tuple,
                   cluster: RayCluster, host: str, port: int) -> None:
    """Deploy the replicas on ``cluster`` behind Serve's proxy on ``host:port`` and block until
    SIGINT or SIGTERM; then stop them. DeployFailed: the replicas did not start."""
    import time

    from ray import serve
    app = replica_app(options, build, build_args)
    handlers = _Signals()
    try:
        cluster.start(host, port)
        handlers.interrupt_on_sigterm()         # after ray.init, which installs its own handler
        try:
            serve.run(app, name=options.name, route_prefix="/")
        except RuntimeError as exc:             # every replica's constructor retry failed
            raise DeployFailed(f"the replicas did not start: {exc} (the replicas' errors are "
                               "in the log above)") from None
        log.info("serving %d replicas on http://%s:%d", options.replicas, host, port)
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        handlers.ignore()                       # a second Ctrl-C must not cut the shutdown short
        log.info("stopping the replicas")
        try:
            cluster.stop(options.name)
        finally:
            handlers.restore()


class _Signals:
    """SIGINT's and SIGTERM's handlers while the replicas run (main thread only; elsewhere
    nothing changes), and those there were before."""

    def __init__(self):
        import signal
        import threading
        self.main = threading.current_thread() is threading.main_thread()
        self.before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def _set(self, handlers: dict) -> None:
        import signal
        if self.main:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def interrupt_on_sigterm(self) -> None:
        """SIGTERM raises KeyboardInterrupt, as Ctrl-C does (the replicas then stop in order)."""
        import signal

        def interrupt(signum, frame):
            raise KeyboardInterrupt
        self._set({signal.SIGTERM: interrupt})

    def ignore(self) -> None:
        import signal
        self._set({s: signal.SIG_IGN for s in self.before})

    def restore(self) -> None:
        """The handlers there were (None: one set outside Python, which cannot be put back)."""
        self._set({s: h for s, h in self.before.items() if h is not None})
