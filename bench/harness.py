"""GDN tree-verification kernels, side by side on one GPU (issue 3; docs/design.md section 8).

For Qwen3.5 GDN layer shapes, batches and tree sizes (depth 8) it times, per layer:

    bole          value-tiled closed-form kernel (tf32 dots; best of a small config sweep; each
                  config's time and error in "bole-config")
    bole-fp32-out the picked launch with O written in fp32 (accuracy without bf16 output rounding)
    bole-ieee     the same kernel in exact-fp32 mode on fp32 copies of the inputs
    tree-serial   node-by-node kernel with one fp32 snapshot per node (SGLang's design; best of its
                  configs, the engines' own launch included)
    fla-chain     fla's fused_recurrent_gated_delta_rule on a chain of the same length (reference;
                  no snapshots, verifies a chain, not a tree)

plus the commits: bole's cross-layer factored commit (all GDN layers, one launch) and the
tree-serial copy commit. Inputs are bf16 (fp32 state), gates fused from raw a/b, q/k l2-normalised
in the kernel, as Qwen3.5 runs, each request's pool slot passed as the engine passes it. Timing:
each kernel captured in a CUDA graph over several input sets (so caches do not flatter it), median
over replays. Byte floor = (S_pre, q, k, v, g, beta read once;
O and U written once) / measured copy bandwidth. rel_err = ||o - o_fp64|| / ||o_fp64|| against the
torch closed form in fp64 on the same (bf16-valued) inputs.

    python bench/harness.py                      # full sweep -> bench/results/kernels-<date>.json/.png
    python bench/harness.py --quick              # a few shapes, to check the set-up
    python bench/harness.py --plot FILE.json     # redraw the plot from a results file
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import functools
import json
import math
import os
import statistics
import sys
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
# Run by path, Python puts bench/ first on sys.path: drop it, so that bench's modules are reached
# as bench.<name> and can never shadow, or be shadowed by, an installed package of the same name.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench")]

from bole.config import gdn_shape  # noqa: E402
from bole.tree import DraftTree, PackedForest  # noqa: E402

MODELS = ("qwen3.5-9b", "qwen3.5-27b", "qwen3.5-122b-a10b")
BATCHES = (1, 4, 16, 64)
NODES = (8, 16, 32, 64, 128)
DEPTH = 8
ROTATE_BYTES = 256 * 2**20       # input sets rotated per timing: at least this many bytes
MAX_BOLE_ERR = 4e-3              # bf16 output: 1.8e-3 measured, 2.0e-3 is bf16's own rounding


# ----------------------------------------------------------------------------- inputs

def config_switches() -> list[str]:
    """The verification kernel's on/off switches: every boolean field of ``VerifyConfig``."""
    from bole.ops.gdn.verify.kernel import VerifyConfig
    return [f.name for f in dataclasses.fields(VerifyConfig) if f.type in ("bool", bool)]


def add_switch_args(ap: argparse.ArgumentParser) -> None:
    """``--<switch> 0 1 ...`` for every :func:`config_switches` entry (``--bf16-state``, ...)."""
    for name in config_switches():
        ap.add_argument("--" + name.replace("_", "-"), nargs="+", type=int, default=None,
                        help=f"VerifyConfig.{name} values (0/1); absent: the base config's")


def with_switches(configs: list, args: argparse.Namespace) -> list:
    """Each config once per combination of the switch values given on the command line."""
    for name in config_switches():
        values = getattr(args, name)
        if values is not None:
            configs = [dataclasses.replace(c, **{name: bool(v)}) for c in configs for v in values]
    return configs


def bench_tree(nodes: int, depth: int, rng: np.random.Generator) -> DraftTree:
    """A random tree of ``nodes`` nodes whose depth is exactly min(depth, nodes - 1)."""
    d = min(depth, nodes - 1)
    parents, depths = list(range(-1, d)), list(range(d + 1))       # a spine of depth d
    for _ in range(nodes - d - 1):
        p = int(rng.choice([j for j in range(len(parents)) if depths[j] < d]))
        parents.append(p)
        depths.append(depths[p] + 1)
    # re-order topologically by depth so parents precede children and siblings sit together
    order = sorted(range(nodes), key=lambda i: (depths[i], i))
    new = {old: n for n, old in enumerate(order)}
    return DraftTree.from_parents([-1 if parents[o] < 0 else new[parents[o]] for o in order])


def bench_forest(nodes: int, batch: int, seed: int, dev) -> tuple[PackedForest, object]:
    """``batch`` random trees of ``nodes`` nodes at depth DEPTH, packed, and their kernel meta."""
    rng = np.random.default_rng(seed)
    forest = PackedForest.pack([bench_tree(nodes, DEPTH, rng) for _ in range(batch)])
    return forest, forest.kernel_meta(dev)


def rotating_sets(shape, forest: PackedForest, dev, seed: int, n_sets: int = 0) -> list[dict]:
    """Input sets of seeds ``seed + 100 i`` to rotate through in one timing: ``n_sets`` of them,
    or (0) enough for ROTATE_BYTES (2 to 16), so that the inputs come from HBM, not L2."""
    first = make_inputs(shape, forest, dev, seed=seed)
    n_sets = n_sets or int(min(16, max(2, math.ceil(ROTATE_BYTES / input_bytes(first)))))
    return [first] + [make_inputs(shape, forest, dev, seed=seed + 100 * i) for i in range(1, n_sets)]


def make_inputs(shape, forest: PackedForest, dev, seed: int):
    gen = torch.Generator(device=dev).manual_seed(seed)
    N, R = forest.num_nodes, forest.num_requests
    Hk, Hv, dk, dv = shape.num_k_heads, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim
    rnd = lambda *s, dt=torch.bfloat16: torch.randn(*s, generator=gen, device=dev).to(dt)  # noqa
    return dict(
        q=rnd(1, N, Hk, dk), k=rnd(1, N, Hk, dk), v=rnd(1, N, Hv, dv),
        a=rnd(1, N, Hv), b=rnd(1, N, Hv),
        A_log=torch.log(torch.empty(Hv, device=dev).uniform_(1, 16, generator=gen)),
        dt_bias=rnd(Hv, dt=torch.float32),
        initial_state=rnd(R, Hv, dk, dv, dt=torch.float32) * 0.1,
        # each request's pool slot, passed as the engine passes it (built once per forward);
        # without it the wrappers build arange(R) on the device, one more launch per call
        # (1.07 us at batch 1 in bench/tuning/ab_kernels.py, in the timings before 2026-11-30's
        # eleventh session)
        slots=torch.arange(R, dtype=torch.int32, device=dev))


def fp32_inputs(x: dict) -> dict:
    """The input set ``x`` with fp32 copies of its (bf16) q, k and v: the same values, for the
    launches that measure accuracy without bf16 operands (the other tensors are shared)."""
    return {n: (t.float() if n in ("q", "k", "v") else t) for n, t in x.items()}


#: tree-serial's launch: the best of its configurations on every Qwen3.5-9B shape
SERIAL_BEST = dict(block_v=32, num_warps=4, num_stages=2)


def verify_inputs(x: dict, meta, *, impl=None, **kw):
    """``tree_gdn_verify_triton`` (or ``impl``, another version of it) on one input set of
    :func:`make_inputs` as Qwen3.5 runs it (raw a/b gates, q/k l2-normalised in the kernel, the
    set's slots as ``state_indices``); ``kw`` as the wrapper takes them (config, ...)."""
    if impl is None:
        from bole.ops.gdn.verify.kernel import tree_gdn_verify_triton as impl
    kw.setdefault("state_indices", x["slots"])
    return impl(x["q"], x["k"], x["v"], meta, initial_state=x["initial_state"], a=x["a"],
                b=x["b"], A_log=x["A_log"], dt_bias=x["dt_bias"], use_qk_l2norm_in_kernel=True,
                **kw)


def serial_inputs(x: dict, meta, snapshots: torch.Tensor, **kw):
    """``tree_gdn_serial_triton`` on one input set as :func:`verify_inputs` runs the verification
    (snapshots into ``snapshots``); ``kw``: its launch (``SERIAL_BEST``'s fields, ...)."""
    from bole.ops.gdn.triton_serial import tree_gdn_serial_triton
    kw.setdefault("state_indices", x["slots"])
    return tree_gdn_serial_triton(x["q"], x["k"], x["v"], meta, initial_state=x["initial_state"],
                                  snapshots=snapshots, a=x["a"], b=x["b"], A_log=x["A_log"],
                                  dt_bias=x["dt_bias"], use_qk_l2norm_in_kernel=True, **kw)


@dataclasses.dataclass
class CommitInputs:
    """The commit benchmarks' inputs: factors and state pool stacked over ``layers`` GDN layers
    (``[Ly, ...]``), every request accepting its deepest-numbered node (depth DEPTH), that path
    padded (``index``, ``lengths``) and the pool slots ``0 .. R - 1``."""
    factors: object
    pool: torch.Tensor
    accepted: list[int]
    index: torch.Tensor
    lengths: torch.Tensor
    slots: torch.Tensor


def commit_inputs(factors, initial_state: torch.Tensor, forest: PackedForest, layers: int,
                  dev) -> CommitInputs:
    """:class:`CommitInputs` of one verify launch's ``factors`` and ``initial_state``."""
    from bole.ops.gdn.closed_form import TreeFactors
    stacked = TreeFactors(*(t.expand(layers, *t.shape).contiguous() for t in (
        factors.log_decay, factors.k, factors.u, factors.k_inv_norm)))
    accepted = (forest.cu_nodes.diff() - 1).tolist()
    index, lengths = forest.padded_paths(accepted)
    return CommitInputs(stacked, initial_state.expand(layers, *initial_state.shape).contiguous(),
                        accepted, index.to(dev), lengths.to(dev),
                        torch.arange(forest.num_requests, device=dev))


def reference_fp64(x, forest: PackedForest):
    """The torch closed form in fp64 on the (bf16-valued) inputs of :func:`make_inputs`, gated and
    normalised as the kernels run them: ``(o, factors)``."""
    from bole.ops.gdn.closed_form import tree_gdn_closed_form
    return tree_gdn_closed_form(
        x["q"].double(), x["k"].double(), x["v"].double(), forest,
        initial_state=x["initial_state"].double(), a=x["a"].double(), b=x["b"].double(),
        A_log=x["A_log"].double(), dt_bias=x["dt_bias"].double(), use_qk_l2norm_in_kernel=True,
        check_values=False)


def input_bytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in x.values())


# ----------------------------------------------------------------------------- results files

@functools.lru_cache(maxsize=None)
def source_commit() -> str:
    """The commit the run's code is at: ``$BOLE_COMMIT`` where it is set (``bench/h200_runs.sh``
    sets it from ``.whl/COMMIT``: the device machine's copy of the working tree may hold a .git
    of an older commit, whose describe would name that one), else ``git describe --always
    --dirty --exclude=*`` of this checkout (the short hash, "-dirty" with uncommitted changes),
    else "unknown". Read once a process: the commit the run started at."""
    import subprocess
    if os.environ.get("BOLE_COMMIT", "").strip():
        return os.environ["BOLE_COMMIT"].strip()
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty", "--exclude=*"],
                              cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        done = None
    if done is not None and done.returncode == 0 and done.stdout.strip():
        return done.stdout.strip()
    return "unknown"


def versions() -> dict:
    """torch's and Triton's versions (:func:`bole.speculative.budget.profile.runtime_versions`)
    and fla's (None where it is not installed)."""
    from importlib import metadata

    from bole.speculative.budget.profile import runtime_versions
    try:
        fla = metadata.version("flash-linear-attention")
    except metadata.PackageNotFoundError:
        fla = None
    return dict(runtime_versions(), fla=fla)


def run_meta(**extra) -> dict:
    """Device, versions (:func:`versions`), commit and date of this GPU run: the head of every
    results JSON (``extra`` added, overriding)."""
    return {"device": torch.cuda.get_device_name(), **versions(), "commit": source_commit(),
            "date": _dt.date.today().isoformat(), **extra}


def results_path(out: str | None, name: str) -> Path:
    """``name`` in ``out``, else in $OUT (the device tool's folder), else in bench/results."""
    out_dir = Path(out or os.environ.get("OUT") or ROOT / "bench" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir / name


def floor_bytes(shape, N: int, R: int) -> int:
    """S_pre, q, k, v (bf16), g, beta (fp32) read once; O (bf16) and U (fp32) written once."""
    Hk, Hv, dk, dv = shape.num_k_heads, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim
    return (R * Hv * dk * dv * 4 + 2 * N * Hk * dk * 2 + N * Hv * dv * 2 + 2 * N * Hv * 4
            + N * Hv * dv * 2 + N * Hv * dv * 4)


def rel_err(o, ref) -> float:
    o, ref = o.double(), ref.double()
    if not torch.isfinite(o).all():
        return float("nan")
    return float((o - ref).norm() / ref.norm())


# ----------------------------------------------------------------------------- timing

def copy_bandwidth(dev) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written)."""
    n = 2**30 // 4
    src, dst = torch.randn(n, device=dev), torch.empty(n, device=dev)
    times = []
    for _ in range(25):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del src, dst
    return 2 * n * 4 / statistics.median(times[5:])


def time_calls(calls, min_ms: float = 150.0) -> float:
    """Median microseconds per call over CUDA-graph replays of all ``calls`` back to back."""
    for c in calls:                      # compile / warm up outside the capture
        c()
    torch.cuda.synchronize()
    graph = None
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for c in calls:
                c()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in calls:
                c()
        run = graph.replay
    except Exception:                    # pragma: no cover - fall back to plain launches
        graph = None

        def run():
            for c in calls:
                c()
    run()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    run()
    e.record()
    torch.cuda.synchronize()
    once = max(s.elapsed_time(e), 1e-3)
    reps = int(min(100, max(5, min_ms / once)))
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        run()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / len(calls))
    del graph
    return statistics.median(times)


#: the verification launches of one config that run_shape makes: (fp32 copies of q/k/v,
#: precision, out dtype) -- bf16 as is, bf16 with fp32 O, fp32 in tf32 and fp32 in IEEE mode
SHAPE_VARIANTS = ((False, None, None), (False, None, torch.float32), (True, "tf32", None),
                  (True, "ieee", None))


def _compile_one(model: str, nodes: int, config_fields: dict, variants: tuple) -> str | None:
    """One worker of :func:`precompile`: launch the config once per variant (as in
    SHAPE_VARIANTS) on a batch-1 forest of ``nodes`` nodes (same strides and alignment as every
    batch, so the same Triton cache entries); the error text, or None."""
    from bole.ops.gdn.verify.kernel import VerifyConfig
    try:
        dev = torch.device("cuda")
        forest, meta = bench_forest(nodes, 1, nodes, dev)
        x = make_inputs(gdn_shape(model), forest, dev, seed=0)
        f32 = fp32_inputs(x)
        for fp32_in, precision, out_dtype in variants:
            verify_inputs(f32 if fp32_in else x, meta, config=VerifyConfig(**config_fields),
                          out_dtype=out_dtype, **({"precision": precision} if precision else {}))
        torch.cuda.synchronize()
        return None
    except Exception as exc:                 # the timing run meets it again and records it
        return repr(exc)[:300]


def precompile(model: str, jobs: list, workers: int, variants: tuple = SHAPE_VARIANTS[:2]) -> None:
    """Compile the verification kernel for ``jobs`` (``(nodes, VerifyConfig)`` pairs) in
    ``workers`` processes at once, into Triton's on-disk cache, so that the timing run (one
    process) only loads them: at d = 128 one launch compiles for 7-40 s, and a run has dozens."""
    import concurrent.futures as cf
    import multiprocessing as mp
    jobs = list(dict.fromkeys(jobs))
    if workers < 2 or len(jobs) < 2:
        return
    with cf.ProcessPoolExecutor(max_workers=min(workers, len(jobs)),
                                mp_context=mp.get_context("spawn")) as pool:
        futures = {pool.submit(_compile_one, model, nodes, dataclasses.asdict(c), variants):
                   (nodes, c) for nodes, c in jobs}
        for job in cf.as_completed(futures):
            if job.result() is not None:
                print(f"precompile {futures[job]}: {job.result()}", flush=True)


# ----------------------------------------------------------------------------- one shape

def sweep_configs(level: str, block_nodes: int):
    """Verification-kernel configurations timed besides the one pick_config chooses."""
    from bole.ops.gdn.verify.kernel import VerifyConfig
    if level == "picked":
        return []
    if level == "small":
        grid = [(16, 64, 4), (32, 64, 4), (64, 32, 4), (128, 32, 4), (128, 32, 8), (64, 64, 8)]
        capped = [(32, 32, 8, 128), (64, 32, 8, 128), (64, 32, 8, 168), (128, 32, 8, 168)]
    else:
        grid = [(bv, bk, nw) for bv in (16, 32, 64, 128) for bk in (32, 64) for nw in (4, 8)]
        capped = [(bv, 32, 8, cap) for bv in (32, 64, 128) for cap in (128, 168)]
    splits = (False, True) if block_nodes >= 128 else (False,)
    return ([VerifyConfig(BV=bv, BK=bk, num_warps=nw, num_stages=2, split_gram=sp)
             for bv, bk, nw in grid for sp in splits]
            + [VerifyConfig(BV=bv, BK=bk, num_warps=nw, num_stages=2, maxnreg=cap)
               for bv, bk, nw, cap in capped])


def run_shape(model: str, batch: int, nodes: int, dev, fla_fn, quick: bool, bw: float,
              sweep: str = "small"):
    from bole.ops.gdn.closed_form import tree_gdn_closed_form
    from bole.ops.gdn.triton_commit import commit_factored_triton
    from bole.ops.gdn.triton_serial import commit_from_snapshots_triton, serial_default_config
    from bole.ops.gdn.verify.kernel import pick_config

    shape = gdn_shape(model)
    forest, meta = bench_forest(nodes, batch, batch * 1000 + nodes, dev)
    N, R = forest.num_nodes, forest.num_requests
    Hk, Hv, dk, dv = shape.num_k_heads, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim
    sets = rotating_sets(shape, forest, dev, seed=nodes * 7 + batch)
    base = sets[0]
    common = dict(use_qk_l2norm_in_kernel=True)      # the fla reference and its closed form
    gate = lambda x: dict(a=x["a"], b=x["b"], A_log=x["A_log"], dt_bias=x["dt_bias"])  # noqa

    ref64, ref_f = reference_fp64(base, forest)
    floor_us = floor_bytes(shape, N, R) / bw * 1e6
    snap_bytes = N * Hv * dk * dv * 4
    factor_bytes = N * Hv * 8 + N * Hv * dv * 4 + N * Hk * 4 + N * Hk * dk * 2
    records = []
    ref_rounded = ref64.to(base["v"].dtype)

    def errors(o, u=None):
        """rel. error vs fp64, vs the fp64 result rounded to the output dtype, and of U."""
        out = dict(rel_err_vs_rounded=float((o.double() - ref_rounded.double()).norm()
                                            / ref64.double().norm()))
        if u is not None:
            out["u_rel_err"] = rel_err(u, ref_f.u)
        return out

    def record(impl, us, err, state_bytes, **extra):
        records.append(dict(model=shape.name, batch=batch, nodes=nodes, depth=forest.max_depth,
                            impl=impl, median_us=us, floor_us=floor_us, rel_err=err,
                            state_bytes=state_bytes, **extra))

    # --- bole: a small sweep of compile-time configs, best one reported as "bole"
    picked = pick_config(meta.block_nodes, dk, dv, R * Hv)
    configs = [picked] + [c for c in sweep_configs(sweep, meta.block_nodes) if c != picked]
    best = None
    for cfg in configs:
        try:
            o, fac = verify_inputs(base, meta, config=cfg)
            err, more = rel_err(o, ref64), errors(o, fac.u)
            us = time_calls([lambda x=x, cfg=cfg: verify_inputs(x, meta, config=cfg)
                             for x in sets])
            cfgd = dataclasses.asdict(cfg)
            record("bole-config", us, err, factor_bytes, config=cfgd, picked=cfg == picked, **more)
            # a config whose output is off (a miscompile, say) never counts as the best
            if err <= MAX_BOLE_ERR and (best is None or us < best[0]):
                best = (us, err, cfgd, more)
            if cfg == picked:
                record("bole-picked", us, err, factor_bytes, config=cfgd, **more)
        except Exception as exc:  # keep going: one failing config must not end the sweep
            record("bole-config", None, None, factor_bytes, config=str(cfg), error=repr(exc))
    if best is not None:
        record("bole", best[0], best[1], factor_bytes, config=best[2], **best[3])

    # --- the same bf16 inputs and launch, O written in fp32: the kernel's own error (tf32 dots),
    #     without bf16's output rounding
    try:
        o, _ = verify_inputs(base, meta, config=picked, out_dtype=torch.float32)
        us = time_calls([lambda x=x: verify_inputs(x, meta, config=picked, out_dtype=torch.float32)
                         for x in sets])
        record("bole-fp32-out", us, rel_err(o, ref64), factor_bytes)
    except Exception as exc:
        record("bole-fp32-out", None, None, factor_bytes, error=repr(exc))

    # --- accuracy without the output rounding: fp32 copies of the same values, O written in fp32,
    #     in the fast tf32 mode and the exact IEEE-fp32 mode (timed only with a full sweep)
    try:
        f32 = [fp32_inputs(x) for x in (sets[:1] if sweep == "picked" else sets)]
        o, _ = verify_inputs(f32[0], meta, precision="tf32", config=picked)
        tf32_err = rel_err(o, ref64)
        o, fac = verify_inputs(f32[0], meta, precision="ieee")
        err = rel_err(o, ref64)
        ieee_u = rel_err(fac.u, ref_f.u)
        us = None if sweep == "picked" else time_calls(
            [lambda x=x: verify_inputs(x, meta, precision="ieee") for x in f32])
        record("bole-ieee", us, err, factor_bytes, u_rel_err=ieee_u)
        record("bole-tf32-fp32-out", None, tf32_err, factor_bytes)
        del f32
    except Exception as exc:
        record("bole-ieee", None, None, factor_bytes, error=repr(exc))

    # --- tree-serial: the engines' launch and a few others, best reported
    snaps = torch.empty(N * Hv * dk * dv, device=dev, dtype=torch.float32)
    # with --sweep picked only the best of these on every Qwen3.5-9B shape
    serial_cfgs = [SERIAL_BEST] if sweep == "picked" else [serial_default_config(dv)] + [
        dict(block_v=bv, num_warps=nw, num_stages=2) for bv, nw in ((16, 2), (32, 4), (64, 4))]
    best = None
    for cfg in serial_cfgs:
        try:
            o, _ = serial_inputs(base, meta, snaps, **cfg)
            err, more = rel_err(o, ref64), errors(o)
            us = time_calls([lambda x=x, cfg=cfg: serial_inputs(x, meta, snaps, **cfg)
                             for x in sets])
            record("tree-serial-config", us, err, snap_bytes, config=cfg, **more)
            if best is None or us < best[0]:
                best = (us, err, cfg, more)
        except Exception as exc:
            record("tree-serial-config", None, None, snap_bytes, config=cfg, error=repr(exc))
    if best is not None:
        record("tree-serial", best[0], best[1], snap_bytes, config=best[2], **best[3])

    # --- fla's fused recurrent kernel on a chain of the same length (reference)
    if fla_fn is not None:
        try:
            chain = PackedForest.from_parents(torch.arange(-1, nodes - 1).expand(batch, nodes))
            def fla_call(x):      # gates fused in fla's kernel too, as in ours
                return fla_fn(x["q"].view(batch, nodes, Hk, dk), x["k"].view(batch, nodes, Hk, dk),
                              x["v"].view(batch, nodes, Hv, dv), g=x["a"].view(batch, nodes, Hv),
                              beta=x["b"].view(batch, nodes, Hv), A_log=x["A_log"],
                              dt_bias=x["dt_bias"], use_gate_in_kernel=True,
                              use_beta_sigmoid_in_kernel=True, initial_state=x["initial_state"],
                              output_final_state=False, use_qk_l2norm_in_kernel=True)
            ref_chain, _ = tree_gdn_closed_form(
                base["q"].double().view(batch, nodes, Hk, dk),
                base["k"].double().view(batch, nodes, Hk, dk),
                base["v"].double().view(batch, nodes, Hv, dv), chain,
                initial_state=base["initial_state"].double(), check_values=False,
                **{n: t.double().view(batch, nodes, Hv) if t.dim() == 3 else t.double()
                   for n, t in gate(base).items()}, **common)
            err = rel_err(fla_call(base)[0], ref_chain)
            us = time_calls([lambda x=x: fla_call(x) for x in sets])
            record("fla-chain", us, err, 0)
        except Exception as exc:
            record("fla-chain", None, None, 0, error=repr(exc))

    # --- commits (only at T = 64): all GDN layers at once vs copy of one snapshot per layer
    if nodes == 64:
        try:
            layers = shape.num_gdn_layers
            _, fac = verify_inputs(base, meta)
            c = commit_inputs(fac, base["initial_state"], forest, layers, dev)
            pool, slots = c.pool, c.slots
            us = time_calls([lambda: commit_factored_triton(c.factors, pool, slots, c.index,
                                                            c.lengths)])
            record("bole-commit-all-layers", us, None, 0, layers=layers)
            # every layer copies its own accepted snapshots (distinct memory, as an engine holds
            # them; one buffer reused for all layers would be read from L2)
            layer_snaps = pool.clone()                      # [Ly, R, H_v, d_k, d_v]
            acc = torch.arange(R, device=dev)
            us = time_calls([lambda: [commit_from_snapshots_triton(layer_snaps[i], pool[i], slots, acc)
                                      for i in range(layers)]])
            record("tree-serial-commit-all-layers", us, None, 0, layers=layers)
            layer_snaps = None
        except Exception as exc:
            record("bole-commit-all-layers", None, None, 0, error=repr(exc))
            traceback.print_exc()
    sets = snaps = None         # free the device memory before the next shape
    torch.cuda.empty_cache()
    return records


# ----------------------------------------------------------------------------- report

def summary(records) -> str:
    by = {}
    for r in records:
        by.setdefault((r["model"], r["batch"], r["nodes"]), {})[r["impl"]] = r
    lines = [f"{'model':<18} {'B':>3} {'T':>4} {'bole us':>8} {'serial us':>9} {'x':>6} "
             f"{'fla us':>7} {'floor us':>8} {'/floor':>6} {'err bf16':>9} {'err rnd':>8} "
             f"{'err ieee':>9} {'err f32o':>9}"]
    for (model, b, t), d in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        bo, se, fl, ie, fo = (d.get(k, {}) for k in ("bole", "tree-serial", "fla-chain", "bole-ieee",
                                                     "bole-fp32-out"))
        fmt = lambda v, p=".1f": "-" if v is None else format(v, p)  # noqa: E731
        ratio = se.get("median_us") / bo["median_us"] if bo.get("median_us") and se.get("median_us") else None
        over = bo["median_us"] / bo["floor_us"] if bo.get("median_us") else None
        lines.append(f"{model:<18} {b:>3} {t:>4} {fmt(bo.get('median_us')):>8} "
                     f"{fmt(se.get('median_us')):>9} {fmt(ratio):>6} {fmt(fl.get('median_us')):>7} "
                     f"{fmt(bo.get('floor_us'), '.2f'):>8} {fmt(over):>6} "
                     f"{fmt(bo.get('rel_err'), '.1e'):>9} {fmt(bo.get('rel_err_vs_rounded'), '.1e'):>8} "
                     f"{fmt(ie.get('rel_err'), '.1e'):>9} {fmt(fo.get('rel_err'), '.1e'):>9}")
    return "\n".join(lines)


def add_output_args(ap: argparse.ArgumentParser) -> None:
    """``--out`` (results folder), ``--tag`` (file-name suffix) and ``--plot`` (only redraw)."""
    ap.add_argument("--out", default=None, help="results folder (default bench/results, or $OUT)")
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    ap.add_argument("--plot", default=None, help="only redraw the plot of this results JSON")


def run_label(meta: dict) -> str:
    """``device, date (torch .., triton ..)`` of a results file's meta, for plot titles."""
    return f"{meta['device']}, {meta['date']} (torch {meta['torch']}, triton {meta['triton']})"


def save_png(fig, path: Path) -> Path:
    """``fig`` laid out and saved next to the results file ``path`` as PNG (then closed)."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot(path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    recs = data["records"]
    models = sorted({r["model"] for r in recs}, key=lambda m: [r["model"] for r in recs].index(m))
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        for b in sorted({r["batch"] for r in recs if r["model"] == model}):
            def series(impl):
                return {r["nodes"]: r["median_us"] for r in recs if r["model"] == model
                        and r["batch"] == b and r["impl"] == impl and r["median_us"]}
            bole, serial, fla = series("bole"), series("tree-serial"), series("fla-chain")
            ts = sorted(set(bole) & set(serial))
            line, = ax.plot(ts, [serial[t] / bole[t] for t in ts], "o-", label=f"B={b} vs tree-serial")
            tf = sorted(set(bole) & set(fla))
            if tf:
                ax.plot(tf, [fla[t] / bole[t] for t in tf], "x--", color=line.get_color(),
                        alpha=0.6, label=f"B={b} vs fla chain")
        ax.axhline(1, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tree nodes T (depth 8)")
        ax.set_ylabel("speed-up of bole (x)")
        ax.set_title(f"{model} GDN layer")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"GDN tree verification per layer, {run_label(data['meta'])}", fontsize=9)
    return save_png(fig, path)


def precompile_model(model: str, batches, nodes, sweep: str, workers: int) -> None:
    """:func:`precompile` every verification launch that run_shape makes for ``model``."""
    from bole.ops.gdn.verify.kernel import pick_config
    shape = gdn_shape(model)
    picked, others = [], []
    for t in nodes:
        bt = bench_forest(t, 1, t, "cpu")[1].block_nodes
        for b in batches:
            picked.append((t, pick_config(bt, shape.head_k_dim, shape.head_v_dim,
                                          b * shape.num_v_heads, interpret=False)))
        others += [(t, c) for c in sweep_configs(sweep, bt)]
    precompile(model, picked, workers, SHAPE_VARIANTS)
    precompile(model, [j for j in others if j not in picked], workers, SHAPE_VARIANTS[:1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few shapes, one config each")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    ap.add_argument("--nodes", nargs="+", type=int, default=list(NODES))
    add_output_args(ap)
    ap.add_argument("--sweep", choices=("full", "small", "picked"), default="small",
                    help="verification-kernel configs timed besides pick_config's (default small)")
    ap.add_argument("--compile-workers", type=int, default=0,
                    help="compile every model's verification launches in this many processes "
                         "first (Triton's disk cache), then time them in this one")
    ap.add_argument("--merge", nargs="+", default=None,
                    help="merge results files (same device and date) into kernels-<date><tag>.json, "
                         "then plot")
    args = ap.parse_args(argv)
    if args.plot:
        print(plot(Path(args.plot)))
        return 0
    if args.merge:
        parts = [json.loads(Path(p).read_text()) for p in args.merge]
        merged = dict(meta=parts[0]["meta"], records=[r for p in parts for r in p["records"]])
        merged["meta"]["merged_from"] = [Path(p).name for p in args.merge]
        out_dir = Path(args.out or ROOT / "bench" / "results")
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"kernels-{parts[0]['meta']['date']}{args.tag}.json"
        path.write_text(json.dumps(merged, indent=1))
        print(summary(merged["records"]))
        print(plot(path))
        return 0
    if not torch.cuda.is_available():
        print("bench/harness.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fn
        import fla
        fla_version = getattr(fla, "__version__", "?")
    except Exception as exc:
        print(f"fla not importable ({exc!r}); the fla-chain reference is skipped", file=sys.stderr)
        fla_fn, fla_version = None, None
    bw = copy_bandwidth(dev)
    meta = run_meta(fla=fla_version, copy_bandwidth_TBps=bw / 1e12, depth=DEPTH,
                    inputs="bf16 q/k/v, raw a/b gates, in-kernel q/k l2norm, fp32 state, "
                           "pool slots passed as state_indices (no arange launch per call)",
                    timing="CUDA graph replay over rotating input sets, median")
    print(json.dumps(meta), flush=True)
    records = []
    quick = "-quick" if args.quick else ""
    path = results_path(args.out, f"kernels-{meta['date']}{quick}{args.tag}.json")
    models = args.models[:1] if args.quick else args.models
    batches = [1, 16] if args.quick else args.batches
    nodes = [64] if args.quick else args.nodes
    for model in models:
        if args.compile_workers > 1:
            precompile_model(model, batches, nodes, "picked" if args.quick else args.sweep,
                             args.compile_workers)
        for b in batches:
            for t in nodes:
                try:
                    recs = run_shape(model, b, t, dev, fla_fn, args.quick, bw,
                                     "picked" if args.quick else args.sweep)
                except Exception:
                    traceback.print_exc()
                    continue
                records += recs
                print(summary(recs).splitlines()[-1], flush=True)
                path.write_text(json.dumps(dict(meta=meta, records=records), indent=1))
    print(summary(records))
    try:
        print(plot(path))
    except Exception as exc:
        print(f"plot failed: {exc!r}")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
