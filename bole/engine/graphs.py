"""CUDA graphs for fixed-shape work: capture per key, replay, an eager fallback that is counted.

Each captured function reads and writes only tensors that outlive it (static input buffers and
the outputs it leaves in them, or tensors it returns and the caller keeps), so a replay runs the
same kernels on new values. All graphs share one memory pool and are captured largest first, as
nano-vllm and SGLang do. On the CPU (or with graphs off) every call runs eagerly, which is also
how the first call of a new shape would run: never silently, it is counted and logged.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Hashable

import torch

log = logging.getLogger("bole.graphs")


class GraphRunner:
    """Captured graphs by key; ``run(key, fn)`` replays the key's graph or runs ``fn`` eagerly."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.device = torch.device(device)
        self.enabled = enabled and self.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.results: dict[Hashable, object] = {}
        self.stats = dict(graph_replays=0, eager_fallbacks=0, captures=0, capture_s=0.0)

    def capture(self, key: Hashable, fn: Callable[[], object], warmup: int = 2) -> object:
        """Warm ``fn`` up (compiling its kernels) on a side stream, then capture it under
        ``key``. Returns what the captured call returned (tensors a later graph may read)."""
        if not self.enabled:
            raise RuntimeError("CUDA graphs are off (CPU or disabled): nothing to capture")
        t0 = time.perf_counter()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            result = fn()
        torch.cuda.synchronize(self.device)
        self.graphs[key] = graph
        self.results[key] = result
        self.stats["captures"] += 1
        self.stats["capture_s"] += time.perf_counter() - t0
        return result

    def run(self, key: Hashable, fn: Callable[[], object]) -> object:
        """Replay ``key``'s graph (returning what its capture returned), or run ``fn`` eagerly:
        counted as an eager fallback when graphs are on."""
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            self.stats["graph_replays"] += 1
            return self.results[key]
        if self.enabled:
            self.stats["eager_fallbacks"] += 1
            log.warning("no CUDA graph for %s: running eagerly", key)
        return fn()

    def has(self, key: Hashable) -> bool:
        return key in self.graphs
