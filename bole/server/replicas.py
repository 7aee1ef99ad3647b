"""Bole engines as Ray Serve replicas (``bole serve --replicas N``; ``pip install "bole[ray]"``).

Two deployments. The engine deployment (:class:`BoleReplica`): N replicas, each one Ray actor
running one engine, answering a request as the single ``bole serve`` does (its status and
headers, then its body or SSE chunks). The ingress deployment
(:class:`~bole.server.replica_ingress.BoleIngress`) behind Ray Serve's HTTP proxy: the FastAPI app
with every OpenAI route, the API key and the request validation, forwarding each generation to
the engines through a ``DeploymentHandle``. The handle's router picks an engine replica for each:
the default power-of-two-choices router, which probes two replicas and sends the request to the
one with fewer requests in flight. An engine replica takes at most ``max_ongoing_requests``
requests at once (the engine's batch): the rest wait at the ingress's handle (up to
``max_queued_requests``, then 503), so that a request reaches a replica only when it can join
the batch. A request whose replica dies before its first byte reached the client is sent again
(:mod:`bole.server.replica_ingress`); a stream that had begun ends with an error event.

``GET /metrics`` answers for every replica (:mod:`bole.server.replica_metrics`: summed, or with
``?by=replica`` labelled per replica), gathered by a broadcast to the replicas. Ray Serve checks
each replica's engine thread and tensor-parallel ranks (``check_health``) and replaces a replica
that failed or died. :class:`RayCluster` starts a Ray instance of its own or joins a cluster.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

log = logging.getLogger("bole.server")

__all__ = ["RAY_EXTRA", "DeployFailed", "RayMissing", "ReplicaOptions", "ReplicaServer", "BoleReplica",
           "RayCluster", "replica_app", "require_ray", "serve_replicas"]

#: how to install what ``--replicas`` needs
RAY_EXTRA = 'pip install "bole[ray]"'
#: the deployments' names (a replica's process title: ``ray::ServeReplica:APP:DEPLOYMENT``)
ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT = "engine", "ingress"
#: requests the ingress takes beyond those the engines can hold or queue (/health, /metrics)
INGRESS_SPARE = 64


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
        return dict(name=ENGINE_DEPLOYMENT, num_replicas=self.replicas,
                    ray_actor_options={"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
                    max_ongoing_requests=self.max_ongoing_requests,
                    max_queued_requests=self.max_queued_requests,
                    graceful_shutdown_timeout_s=self.shutdown_timeout,
                    health_check_period_s=self.health_check_period_s,
                    logging_config={"enable_access_log": self.access_log})

    def ingress_options(self) -> dict[str, Any]:
        """The ingress deployment's: one replica reserving no core (it relays), taking every
        request (they wait at its handle for an engine replica, up to
        ``max_queued_requests``)."""
        return dict(name=INGRESS_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0},
                    max_ongoing_requests=self.max_queued_requests
                    + self.replicas * self.max_ongoing_requests + INGRESS_SPARE,
                    graceful_shutdown_timeout_s=self.shutdown_timeout,
                    logging_config={"enable_access_log": self.access_log})


@dataclass
class ReplicaServer:
    """What a replica's build returns when the replica has processes besides its own
    (tensor-parallel ranks): the server, and whether those processes still run."""

    server: Any
    alive: Callable[[], bool] | None = None


class BoleReplica:
    """One engine replica: ``build(*build_args)`` makes its :class:`~bole.server.api.BoleServer`
    (engine included; or a :class:`ReplicaServer`) in the replica's process; the ingress sends it
    requests (:meth:`generate`)."""

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
        self.server.loop.start()

    async def generate(self, body: bytes, chat: bool) -> AsyncIterator:
        """One completion or chat request (its JSON ``body``), answered as ``bole serve``
        answers it: first ``(status, headers)``, then the body (one chunk, or SSE chunks)."""
        from contextlib import aclosing

        from fastapi.responses import JSONResponse, StreamingResponse

        from bole.server.protocol import ChatCompletionRequest, CompletionRequest
        from bole.server.responses import respond
        if self.server.event_loop is None:
            self.server.event_loop = asyncio.get_running_loop()
        req = (ChatCompletionRequest if chat else CompletionRequest).model_validate_json(body)
        res = await respond(self.server, req, _Connected(), chat)
        if isinstance(res, dict):                   # a whole response's body
            res = JSONResponse(res)
        yield res.status_code, [(k.decode("latin-1"), v.decode("latin-1"))
                                for k, v in res.raw_headers]
        if isinstance(res, StreamingResponse):
            async with aclosing(res.body_iterator) as chunks:     # cancelled: slots freed
                async for chunk in chunks:
                    yield chunk
        else:
            yield res.body

    def health(self) -> tuple[int, dict]:
        """``GET /health`` of this replica: its status code and body."""
        from bole.server.protocol import error_body
        if not self.server.loop.healthy():
            return 503, error_body("the engine stopped; restart the server", "server_error")
        return 200, {"status": "ok", "running": self.server.scheduler.num_running,
                     "waiting": self.server.scheduler.num_waiting}

    def model_card(self) -> dict:
        """The served model's ``/v1/models`` entry."""
        spec, server = self.server.info.spec, self.server
        return {"id": server.model_name, "object": "model", "created": 0, "owned_by": "bole",
                "max_model_len": server.info.max_len,
                "bole": {"mode": spec.mode, "drafter": spec.drafter, "depth": spec.depth,
                         "topk": spec.topk, "budget": spec.budget}}

    def __del__(self):
        """Ray Serve stops this replica: the engine thread stops."""
        server = getattr(self, "server", None)
        if server is not None:
            server.loop.stop()
            server.text_pool.shutdown(wait=False, cancel_futures=True)

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


class _Connected:
    """The HTTP request :func:`~bole.server.responses.respond` polls for a client gone away:
    under Ray Serve a client that goes away cancels the call instead."""

    async def is_disconnected(self) -> bool:
        return False


def replica_app(options: ReplicaOptions, build: Callable[..., Any], build_args: tuple = (),
                api_key: str | None = None):
    """The Ray Serve application: the ingress (:class:`~bole.server.replica_ingress.BoleIngress`,
    checking ``api_key``) in front of ``options.replicas`` engine replicas, each serving
    ``build(*build_args)`` (a :class:`~bole.server.api.BoleServer`); ``serve.run`` it."""
    require_ray()
    from ray import serve

    from bole.server.replica_ingress import BoleIngress
    threads = None if options.num_gpus else max(1, int(options.num_cpus))
    engine = serve.deployment(**options.deployment_options())(BoleReplica)
    ingress = serve.deployment(**options.ingress_options())(serve.ingress()(BoleIngress))
    return ingress.bind(engine.bind(build, build_args, threads), api_key)


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
                   cluster: RayCluster, host: str, port: int, api_key: str | None = None) -> None:
    """Deploy the replicas on ``cluster`` behind Serve's proxy on ``host:port`` and block until
    SIGINT or SIGTERM; then stop them. DeployFailed: the replicas did not start."""
    import time

    from ray import serve
    app = replica_app(options, build, build_args, api_key)
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
