"""A stand-in for CUDA graphs on the CPU, for testing what the round captures and replays.

A CUDA graph's replay runs the captured kernels again on the same memory: the tensors its
capture returned are rewritten in place, and every Python value the captured function read or
returned stays as it was at capture. :class:`StandInGraphs` keeps those semantics without a
GPU: a "replay" calls the function again and copies each tensor it returns into the tensor the
capture returned (a graph that returned new shapes would fail loudly here), leaving non-tensor
values as captured; the function's closure is frozen at capture (a loop variable it reads
keeps the value it had then, as the traced kernels' arguments do). What it cannot reproduce: a
Python branch taken at capture is taken again at replay on the state of then (a real graph
froze it), and the capture runs the function (a real one only traces).
"""

from __future__ import annotations

import dataclasses
import types

import torch

from bole.engine.graphs import GraphRunner


def copy_into(dst, src, seen: set | None = None) -> None:
    """Write every tensor of ``src`` into the tensor at the same place in ``dst`` (tuples,
    lists, dicts, dataclasses and plain objects walked alike); other values left alone."""
    seen = set() if seen is None else seen
    if id(dst) in seen:
        return
    seen.add(id(dst))
    if isinstance(dst, torch.Tensor):
        if not isinstance(src, torch.Tensor) or src.shape != dst.shape:
            raise AssertionError(f"a replay returned {type(src).__name__} "
                                 f"{getattr(src, 'shape', '')} where its capture returned a "
                                 f"tensor {tuple(dst.shape)}")
        if src.data_ptr() != dst.data_ptr():
            dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        assert len(dst) == len(src), "a replay returned another number of values"
        for d, s in zip(dst, src):
            copy_into(d, s, seen)
    elif isinstance(dst, dict):
        for k in dst:
            if k in src:
                copy_into(dst[k], src[k], seen)
    elif dataclasses.is_dataclass(dst) or hasattr(dst, "__dict__"):
        for k, d in vars(dst).items():
            if hasattr(src, k):
                copy_into(d, getattr(src, k), seen)


def frozen(fn):
    """``fn`` with its closure's variables bound to their values now."""
    if not isinstance(fn, types.FunctionType) or not fn.__closure__:
        return fn
    cells = tuple(types.CellType(c.cell_contents) for c in fn.__closure__)
    return types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)


class _Replay:
    def __init__(self, runner: "StandInGraphs", key, fn):
        self.runner, self.key, self.fn = runner, key, fn

    def replay(self) -> None:
        self.runner.replayed.append(self.key)
        try:
            copy_into(self.runner.results[self.key], self.fn())
        except AssertionError as e:
            raise AssertionError(f"{self.key}: {e}") from None


class StandInGraphs(GraphRunner):
    """GraphRunner's bookkeeping with stand-in graphs: ``captured`` lists the keys in capture
    order, ``warmups`` each capture's warm-up count, ``replayed`` every replay's key."""

    def __init__(self, device, enabled: bool = True):
        super().__init__(torch.device("cpu"), enabled=False)
        self.device, self.enabled = torch.device(device), enabled
        self.captured: list = []
        self.warmups: list[int] = []
        self.replayed: list = []

    def capture(self, key, fn, warmup: int = 2):
        if not self.enabled:
            raise RuntimeError("CUDA graphs are off (CPU or disabled): nothing to capture")
        if key in self.graphs:
            raise AssertionError(f"{key} captured twice")
        for _ in range(warmup):
            fn()
        result = fn()
        self.graphs[key], self.results[key] = _Replay(self, key, frozen(fn)), result
        self.captured.append(key)
        self.warmups.append(warmup)
        self.stats["captures"] += 1
        return result
