"""Calibrating the verification budget on this device (``bole calibrate``).

``T_dec(b)`` is a decode forward of ``b`` requests; ``T_ver(b, N)`` a verify forward of ``b``
requests holding ``N`` draft nodes in all, as the round runs it: the nodes spread evenly, each
row padded to the verify width bucket (:func:`bole.speculative.budget.spread_width`). Every
request has ``context`` committed tokens. On a GPU each forward is captured in a CUDA graph and
timed over replays with device events (the median), as the round replays it; on the CPU it runs
eagerly under a wall clock. ``B_ver(b)`` is then the largest ``N`` whose forward costs at most
``(1 + eps)`` times the decode (:func:`bole.speculative.budget.profile.calibrate`). ``T_select(b)``
is the goodput policy's selection over ``b`` whole trees, timed the same way: where dropping
nodes saves less verify time than the selection costs, rounds verify whole trees without it
(:meth:`bole.speculative.budget.policy.PolicyBase.whole_trees`).
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

from bole.engine.buckets import buckets_upto
from bole.engine.runner import ModelRunner
from bole.speculative.budget.round_select import Goodput, select
from bole.speculative.budget.widths import spread_width, width_buckets
from bole.forest import DenseForest
from bole.speculative.budget.acceptance import AcceptanceCalibrator
from bole.speculative.budget.profile import (BudgetProfile, calibrate, config_hash, find_profile,
                                             gpu_name, plot_profile, ProfileFormatError,
                                             runtime_versions)
from bole.tree import DraftTree, PackedForest

DEFAULT_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def captured_ms(fn, device: torch.device, reps: int) -> float:
    """Median milliseconds of ``fn``: graph replays under device events on a GPU, eager calls
    under a wall clock on the CPU."""
    fn()
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize(device)
        times.append(a.elapsed_time(b))
    del graph
    return statistics.median(times)


def forward_time_fn(model, spec, max_batch: int, *, context: int = 1024, reps: int = 10,
                    seed: int = 0):
    """``time_fn(b, N)`` timing this model's decode (N = 0) and verify forwards."""
    T = spec.nodes_per_request
    gdn = "triton" if model.device.type == "cuda" else "torch"
    runner = ModelRunner(model, model.new_cache(max_batch, context + T + 2), gdn)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (context,), generator=gen)
    slots = [runner.cache.allocate(context + T + 2) for _ in range(max_batch)]
    runner.prefill(slots[0], prompt)
    for s in slots[1:]:                          # the same committed context in every slot
        runner.cache.copy_slot(slots[0], s)
    rng = np.random.default_rng(seed)
    dev = model.device

    def time_fn(b: int, n: int) -> float:
        slot_t = torch.tensor(slots[:b], dtype=torch.int32, device=dev)
        if n == 0:
            dense = DenseForest.chain(b, 1, dev)
        else:
            per_row = -(-n // b)
            W = spread_width(b, n, T)
            trees = [DraftTree.random(min(W, per_row + 1), min(spec.depth, per_row), rng)
                     for _ in range(b)]
            dense = DenseForest.from_packed(PackedForest.pack(trees), W, device=dev)
        tokens = torch.randint(0, model.config.vocab_size, (dense.num_nodes,), device=dev)

        # plain decoding as ar runs it: the in-place decode step (states change: timing only)
        step = ("triton-decode" if dev.type == "cuda" else "torch-decode") if n == 0 else None

        def forward():
            forest = DenseForest.from_parents(dense.parents, dense.valid, dense.max_depth)
            runner.forward(runner.make_batch(tokens, forest, slot_t, step))
        return captured_ms(forward, dev, reps)
    return time_fn


def selection_time_fn(spec, device, *, reps: int = 10, seed: int = 0):
    """``select_fn(b)`` timing the goodput policy's selection (the ranking, the floors, its
    choice of verify width, the fill and the compaction) over ``b`` random whole trees of the
    spec's shape, at the full width, as a verify graph runs it before its forward."""
    T, D = spec.nodes_per_request, spec.depth
    rng = np.random.default_rng(seed)
    acceptance = AcceptanceCalibrator.log_bins(device=device)
    widths = width_buckets(T)
    goodput = Goodput.on(device, widths, [1.0] * len(widths))

    def select_fn(b: int) -> float:
        trees = [DraftTree.random(T, D, rng) for _ in range(b)]
        dense = DenseForest.from_packed(PackedForest.pack(trees), T, device=device)
        parents, valid = dense.parents.view(b, T), dense.valid.view(b, T)
        rho = torch.rand(b, T, dtype=torch.float64, device=device).masked_fill(~valid, 0.0)
        rho[:, 0] = 1.0
        tokens = torch.zeros(b, T, dtype=torch.int64, device=device)
        budget = torch.zeros((), dtype=torch.int64, device=device)
        active = torch.ones(b, dtype=torch.bool, device=device)
        return captured_ms(lambda: select(rho, tokens, parents, valid, budget, active,
                                          spec.root_floor, T, D, goodput=goodput,
                                          acceptance=acceptance), device, reps)
    return select_fn


def calibrate_model(model, spec, batches, *, node_grid=DEFAULT_GRID, eps: float = 0.1,
                    context: int = 1024, reps: int = 10, progress: bool = True) -> BudgetProfile:
    """Measure, build and save this device's profile for ``model`` (with a plot beside it)."""
    batches = sorted(set(batches))
    T = spec.nodes_per_request
    full = max(batches) * (T - 1)                # every draft node of the largest batch
    grid = [n for n in node_grid if n < full] + [full]
    time_fn = forward_time_fn(model, spec, max(batches), context=context, reps=reps)

    def bar(done, total):
        if progress:
            filled = int(30 * done / total)
            print(f"\r[bole] calibrating [{'#' * filled}{'.' * (30 - filled)}] {done}/{total}",
                  end="" if done < total else "\n", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    select_fn = selection_time_fn(spec, model.device, reps=reps)
    profile = calibrate(time_fn, batches, grid, eps, tree_nodes=T, gpu=gpu_name(model.device),
                        config_hash=config_hash(model.config), dtype=model.dtype,
                        versions=runtime_versions(), progress=bar, select_fn=select_fn,
                        model=f"hidden {model.config.hidden_size}, "
                              f"{model.config.num_hidden_layers} layers")
    path = profile.save()
    plot_profile(profile, path.with_suffix(".png"))
    if progress:
        print(f"[bole] calibrated in {time.perf_counter() - t0:.0f} s: {path}", file=sys.stderr)
    return profile


def load_or_calibrate(model, spec, max_batch: int) -> BudgetProfile:
    """This device's saved profile for ``model`` and the spec's tree size, or a new calibration
    (with a message)."""
    key = (gpu_name(model.device), config_hash(model.config), model.dtype, runtime_versions(),
           spec.nodes_per_request)
    try:
        profile = find_profile(*key)
    except ProfileFormatError as e:
        print(f"[bole] {e}: calibrating now", file=sys.stderr)
        return calibrate_model(model, spec, buckets_upto(max_batch))
    nodes = max_batch * (spec.nodes_per_request - 1)
    if profile is not None and max(profile.batches) >= max_batch \
            and max(profile.node_grid) >= nodes:
        return profile
    if profile is None:
        print("[bole] no verification-budget profile for this GPU, model, dtype, versions and "
              f"tree size ({spec.nodes_per_request} nodes): calibrating now (bole calibrate "
              "does it ahead of time)", file=sys.stderr)
    else:
        print(f"[bole] the saved verification-budget profile reaches batch "
              f"{max(profile.batches)} and {max(profile.node_grid)} draft nodes; this engine "
              f"needs batch {max_batch} and {nodes}: calibrating again", file=sys.stderr)
    return calibrate_model(model, spec, buckets_upto(max_batch))
