"""Hardware calibration of the verification budget, and of acceptance against rho.

A :class:`BudgetProfile` holds what one GPU measured for one model, dtype, software stack and
tree size:
plain decoding's time ``T_dec(b)`` and the verify forward's time ``T_ver(b, N)`` over a grid of
``N`` = draft nodes in the whole batch (roots excluded; ``N = 0`` is plain decoding), and the
paper's budget ``B_ver(b)``: the largest measured N with ``T_ver(b, N) <= (1 + eps) T_dec(b)``,
raised to the most nodes its verify width holds (:func:`b_ver_from_curve`: the round's verify is
dense, each row padded to a width bucket, so every count up to that width's capacity costs the
time measured at N).
Profiles live as JSON under ``$BOLE_CACHE`` (default ``~/.cache/bole/``), one file per key
(GPU name, model config hash, dtype, torch and triton versions, nodes per tree).

:func:`calibrate` builds a profile from any timing callable, so the GPU run only supplies
``time_fn(batch, nodes) -> ms``. :class:`AcceptanceCalibrator` maps rho to the acceptance
observed per model (binned counts, made monotone by pool adjacent violators).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import weakref
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
from torch import Tensor

from bole.speculative.budget import width_capacity

__all__ = ["FORMAT", "BudgetProfile", "ProfileFormatError", "cache_dir", "config_hash",
           "runtime_versions", "gpu_name", "dtype_name", "profile_path", "find_profile",
           "b_ver_from_curve", "calibrate", "verification_budget", "plot_profile", "isotonic_fit",
           "isotonic_fit_device", "AcceptanceCalibrator"]

_INF = float("inf")

#: version of the profile's JSON layout (2: ``t_select``; 3: ``tree_nodes``, in the key; 4:
#: ``b_ver`` at its verify width's capacity)
FORMAT = 4

#: ``time_fn(batch, nodes) -> ms``: one round's verify forward over ``batch`` requests holding
#: ``nodes`` draft nodes in all (plus one root each); ``nodes == 0`` is plain decoding
TimeFn = Callable[[int, int], float]


# ---- the key ----
def cache_dir() -> Path:
    """``$BOLE_CACHE``, or ``~/.cache/bole/`` when it is unset or empty."""
    env = os.environ.get("BOLE_CACHE", "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "bole"


def config_hash(config) -> str:
    """16 hex digits of SHA-256 over every field of a :class:`HybridConfig` (sorted JSON)."""
    fields = dataclasses.asdict(config)
    blob = json.dumps(fields, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def runtime_versions() -> dict[str, str]:
    """``{"torch": ..., "triton": ...}`` of this process ("none" without triton)."""
    try:
        triton = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton = "none"
    return {"torch": torch.__version__, "triton": triton}


def gpu_name(device: torch.device | str | None = None) -> str:
    """The device's marketing name (``torch.cuda.get_device_name``), "cpu" off CUDA."""
    device = torch.device(device if device is not None else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` or "bfloat16" -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-") or "unknown"


def profile_path(gpu: str, config_hash: str, dtype: torch.dtype | str,
                 versions: Mapping[str, str], tree_nodes: int, root: Path | None = None) -> Path:
    """Where the profile of this key lives:
    ``budget-<gpu>-<hash>-<dtype>-torch<v>-triton<v>-tree<T>.json`` under ``root`` (default
    :func:`cache_dir`)."""
    name = "-".join(["budget", _slug(gpu), _slug(config_hash), _slug(dtype_name(dtype)),
                     "torch" + _slug(versions.get("torch", "")),
                     "triton" + _slug(versions.get("triton", "")), f"tree{int(tree_nodes)}"])
    return (root if root is not None else cache_dir()) / f"{name}.json"


# ---- the profile ----
class ProfileFormatError(ValueError):
    """A profile written by another Bole, in another JSON layout: calibrate again."""


@dataclasses.dataclass
class BudgetProfile:
    """One GPU's verify-time curve for one model, dtype, software stack and tree size.

    batches:   measured batch sizes, ascending.
    node_grid: measured N (draft nodes over the batch, roots excluded), ascending, all > 0.
    t_dec:     ``[len(batches)]`` plain decoding's ms per round.
    t_ver:     ``[len(batches)][len(node_grid)]`` the verify forward's ms.
    b_ver:     ``[len(batches)]`` the largest N with ``t_ver <= (1 + eps) t_dec`` (0 if none), at
               its verify width's capacity (:func:`b_ver_from_curve`).
    t_select:  ``[len(batches)]`` ms of the goodput policy's selection over whole trees (the
               device-side choice, ranking, floors and compaction a shared verify adds).
    tree_nodes: the nodes per request (root included) of the trees it was measured for: a
               round pads each row to a verify width of :func:`~bole.speculative.budget.
               width_buckets` of it (powers of two, and the tree's size as the widest), and the
               selection ranks whole trees of it, so a profile serves only trees of this size.
    """

    gpu: str
    config_hash: str
    dtype: str
    torch_version: str
    triton_version: str
    eps: float
    batches: list[int]
    node_grid: list[int]
    t_dec: list[float]
    t_ver: list[list[float]]
    b_ver: list[int]
    t_select: list[float]
    tree_nodes: int
    model: str = ""
    created: str = ""

    def __post_init__(self) -> None:
        self.dtype = dtype_name(self.dtype)
        nb, ng = len(self.batches), len(self.node_grid)
        if nb == 0 or ng == 0:
            raise ValueError("a budget profile needs at least one batch and one grid point")
        if list(self.batches) != sorted(set(self.batches)) or self.batches[0] < 1:
            raise ValueError(f"batches must be distinct, ascending and >= 1, got {self.batches}")
        if list(self.node_grid) != sorted(set(self.node_grid)) or self.node_grid[0] < 1:
            raise ValueError(f"node_grid must be distinct, ascending and >= 1, got "
                             f"{self.node_grid}")
        if isinstance(self.tree_nodes, bool) or not isinstance(self.tree_nodes, int) \
                or self.tree_nodes < 2:
            raise ValueError(f"tree_nodes must be an int >= 2 (a root and a draft node), got "
                             f"{self.tree_nodes!r}")
        if (len(self.t_dec) != nb or len(self.b_ver) != nb or len(self.t_select) != nb
                or len(self.t_ver) != nb or any(len(row) != ng for row in self.t_ver)):
            raise ValueError(f"t_dec, b_ver, t_select need {nb} entries and t_ver {nb} rows "
                             f"of {ng}")

    # ---- the key ----
    @property
    def versions(self) -> dict[str, str]:
        return {"torch": self.torch_version, "triton": self.triton_version}

    def differences(self, gpu: str, config_hash: str, dtype: torch.dtype | str,
                    versions: Mapping[str, str], tree_nodes: int) -> list[str]:
        """Every key field where this profile differs from the running setup, as text."""
        here = {"GPU": gpu, "model config hash": config_hash, "dtype": dtype_name(dtype),
                "torch": versions.get("torch", ""), "triton": versions.get("triton", ""),
                "tree nodes": tree_nodes}
        mine = {"GPU": self.gpu, "model config hash": self.config_hash, "dtype": self.dtype,
                "torch": self.torch_version, "triton": self.triton_version,
                "tree nodes": self.tree_nodes}
        return [f"{name}: profile {mine[name]!r}, here {here[name]!r}"
                for name in here if str(here[name]) != str(mine[name])]

    def check(self, gpu: str, config_hash: str, dtype: torch.dtype | str,
              versions: Mapping[str, str], tree_nodes: int) -> None:
        """Raise ``ValueError`` naming every difference between the profile and this setup."""
        diff = self.differences(gpu, config_hash, dtype, versions, tree_nodes)
        if diff:
            what = f" ({self.model})" if self.model else ""
            raise ValueError(f"the budget profile{what} was measured on another setup: "
                             + "; ".join(diff) + ". Recalibrate with `bole calibrate` (with "
                             "this engine's --depth, --topk and --budget for its tree size).")

    # ---- lookups at a batch (the rule of verification_budget) ----
    def row(self, batch: int) -> int:
        """The measured batch a round of ``batch`` requests uses: the smallest measured batch
        >= ``batch``, or the largest measured one above them all."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        return next((i for i, b in enumerate(self.batches) if b >= batch), len(self.batches) - 1)

    def t_dec_at(self, batch: int) -> float:
        return float(self.t_dec[self.row(batch)])

    def t_select_at(self, batch: int) -> float:
        return float(self.t_select[self.row(batch)])

    def at_eps(self, eps: float) -> "BudgetProfile":
        """This profile with ``B_ver`` derived again at tolerance ``eps`` from the same curves
        (no measuring: the paper leaves ``eps`` to the user, and this is how to sweep it)."""
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        b_ver = [b_ver_from_curve(t, self.node_grid, row, eps, rows=b, tree_nodes=self.tree_nodes)
                 for b, t, row in zip(self.batches, self.t_dec, self.t_ver)]
        return dataclasses.replace(self, eps=float(eps), b_ver=b_ver)

    def t_ver_curve(self, batch: int) -> dict[int, float]:
        """``{N: ms}`` of the verify forward at ``batch`` (for :func:`goodput_choice`)."""
        return {int(n): float(t) for n, t in zip(self.node_grid, self.t_ver[self.row(batch)])}

    # ---- files ----
    def path(self, root: Path | None = None) -> Path:
        return profile_path(self.gpu, self.config_hash, self.dtype, self.versions,
                            self.tree_nodes, root)

    def to_dict(self) -> dict:
        return {"format": FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, raw: dict, source: str = "profile") -> "BudgetProfile":
        if raw.get("format") != FORMAT:
            raise ProfileFormatError(f"{source}: budget profile format {raw.get('format')!r}, "
                                     f"this Bole reads format {FORMAT}; recalibrate with "
                                     "`bole calibrate`")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(n for n in names if n not in raw and n not in ("model", "created"))
        if missing:
            raise ValueError(f"{source}: budget profile lacks {', '.join(missing)}")
        return cls(**{k: v for k, v in raw.items() if k in names})

    def save(self, path: Path | str | None = None) -> Path:
        """Write the JSON (default: :meth:`path` under :func:`cache_dir`), atomically."""
        path = Path(path) if path is not None else self.path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: Path | str) -> "BudgetProfile":
        path = Path(path)
        return cls.from_dict(json.loads(path.read_text()), source=str(path))


def find_profile(gpu: str, config_hash: str, dtype: torch.dtype | str,
                 versions: Mapping[str, str], tree_nodes: int,
                 root: Path | None = None) -> BudgetProfile | None:
    """The cached profile of this key, or None when there is none (then calibrate). A file
    whose contents disagree with its key is refused by :meth:`BudgetProfile.check`."""
    path = profile_path(gpu, config_hash, dtype, versions, tree_nodes, root)
    if not path.exists():
        return None
    profile = BudgetProfile.load(path)
    profile.check(gpu, config_hash, dtype, versions, tree_nodes)
    return profile


# ---- measuring ----
def b_ver_from_curve(t_dec: float, node_grid: Sequence[int], t_ver: Sequence[float],
                     eps: float, *, rows: int | None = None, tree_nodes: int | None = None) -> int:
    """The largest N of the grid with ``T_ver(N) <= (1 + eps) T_dec``; 0 when none is.

    Given the batch's ``rows`` and the trees' ``tree_nodes``, that N is raised to the capacity of
    its verify width (:func:`~bole.speculative.budget.width_capacity`): the round spreads the
    nodes over its rows and pads each to a width bucket, so the time measured at N is the time
    of every count up to ``rows (W - 1)``, and the paper's "largest N within the tolerance" is
    that capacity (a profile's grid holds powers of two, which at most batches fall short of a
    width's capacity: 128 nodes at batch 64 pay the width 4 that holds 192). Where another grid
    point of the same width measured above the tolerance (timing noise at the edge), N stays
    as it is."""
    limit = (1.0 + eps) * t_dec
    n = max((int(n) for n, t in zip(node_grid, t_ver) if t <= limit), default=0)
    if rows is None or tree_nodes is None or n == 0:
        return n
    cap = width_capacity(int(rows), n, int(tree_nodes))
    same_width_failed = any(n < m <= cap and t > limit for m, t in zip(node_grid, t_ver))
    return n if same_width_failed else cap


def calibrate(time_fn: TimeFn, batches: Sequence[int], node_grid: Sequence[int],
              eps: float = 0.1, *, tree_nodes: int, gpu: str = "unknown", config_hash: str = "",
              dtype: torch.dtype | str = "", versions: Mapping[str, str] | None = None,
              model: str = "", select_fn: Callable[[int], float] | None = None,
              progress: Callable[[int, int], None] | None = None) -> BudgetProfile:
    """Measure ``T_dec`` = ``time_fn(b, 0)`` and ``T_ver`` = ``time_fn(b, N)`` for every batch
    and grid point, and derive ``B_ver``; ``T_select`` = ``select_fn(b)`` (0 without one).
    ``tree_nodes``: the tree size (root included) ``time_fn`` and ``select_fn`` measure.
    ``progress(done, total)`` is called after each point (a progress bar). The key fields are
    stored as given (``versions`` defaults to :func:`runtime_versions`)."""
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    batches, grid = sorted({int(b) for b in batches}), sorted({int(n) for n in node_grid})
    versions = dict(versions) if versions is not None else runtime_versions()
    total, done = len(batches) * (1 + len(grid)), 0
    t_dec, t_ver, b_ver, t_select = [], [], [], []
    for b in batches:
        times = []
        for n in [0, *grid]:
            times.append(float(time_fn(b, n)))
            done += 1
            if progress is not None:
                progress(done, total)
        t_dec.append(times[0])
        t_ver.append(times[1:])
        t_select.append(float(select_fn(b)) if select_fn is not None else 0.0)
        b_ver.append(b_ver_from_curve(times[0], grid, times[1:], eps, rows=b,
                                      tree_nodes=tree_nodes))
    return BudgetProfile(gpu=gpu, config_hash=config_hash, dtype=dtype_name(dtype),
                         torch_version=versions.get("torch", ""),
                         triton_version=versions.get("triton", ""), eps=float(eps),
                         batches=batches, node_grid=grid, t_dec=t_dec, t_ver=t_ver,
                         b_ver=b_ver, t_select=t_select, tree_nodes=int(tree_nodes),
                         model=model,
                         created=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def verification_budget(profile: BudgetProfile, batch: int) -> int:
    """``B_ver`` for a round of ``batch`` requests.

    Rule: the value of the smallest measured batch >= ``batch`` (the largest measured batch's
    above them all). A round pads its rows to a batch bucket (1, 2, 4, ...) and pays for the
    padded rows, so when the calibration measures the buckets this is the exact measurement of
    the round that runs, not an interpolation; between other measured batches it takes the
    measurement of the larger batch, which errs towards fewer nodes when ``B_ver`` falls with the
    batch (the verify forward turns compute-bound sooner as rows are added). Linear interpolation
    in log batch would invent budgets for batch sizes that never run."""
    return int(profile.b_ver[profile.row(batch)])


def plot_profile(profile: BudgetProfile, path: Path | str) -> Path:
    """PNG of ``T_ver(N)`` per batch (log-log), each batch's ``(1 + eps) T_dec`` dashed and its
    ``B_ver`` marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, b in enumerate(profile.batches):
        color = f"C{i % 10}"
        ax.plot(profile.node_grid, profile.t_ver[i], "o-", color=color, ms=3, label=f"batch {b}")
        ax.axhline((1 + profile.eps) * profile.t_dec[i], color=color, ls="--", lw=0.8)
        limit = (1 + profile.eps) * profile.t_dec[i]
        within = [t for t in profile.t_ver[i] if t <= limit]
        if profile.b_ver[i] > 0 and within:      # B_ver at the time of the point it came from
            ax.plot([profile.b_ver[i]], [within[-1]], "*", color=color, ms=14, mec="k")
    ax.set(xscale="log", yscale="log", xlabel="draft nodes verified (whole batch)",
           ylabel="verify forward (ms)",
           title=f"{profile.model or profile.config_hash} on {profile.gpu}, {profile.dtype}: "
                 f"B_ver (stars) at (1 + {profile.eps:g}) T_dec (dashed)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- acceptance against rho ----
def isotonic_fit(y: Sequence[float], weights: Sequence[float] | None = None) -> list[float]:
    """Weighted least-squares non-decreasing fit of ``y`` in its order: pool adjacent violators.

    Blocks of pooled values are kept on a stack as (mean, weight, length); a new value that
    breaks monotonicity merges with the blocks before it until their means are in order."""
    w = [1.0] * len(y) if weights is None else [float(x) for x in weights]
    if len(w) != len(y) or any(x <= 0 for x in w):
        raise ValueError("weights must be positive, one per value")
    blocks: list[list[float]] = []
    for value, weight in zip(y, w):
        blocks.append([float(value), weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [mean for mean, _, n in blocks for _ in range(int(n))]


def isotonic_fit_device(y: Tensor, weights: Tensor) -> Tensor:
    """:func:`isotonic_fit` of ``y [K]`` with positive ``weights [K]`` as tensor code (no host
    synchronisation), by the min-max formula of isotonic regression:
    ``fit[i] = max_{j <= i} min_{k >= i} mean(y[j..k])``, the means weighted, over ``[K, K]``
    interval means from prefix sums (K is a handful of bins)."""
    K = y.shape[0]
    w = weights.to(torch.float64)
    zero = torch.zeros(1, dtype=torch.float64, device=y.device)
    sw = torch.cat([zero, torch.cumsum(w, 0)])
    swy = torch.cat([zero, torch.cumsum(w * y.to(torch.float64), 0)])
    idx = torch.arange(K, device=y.device)
    j, k = idx[:, None], idx[None, :]
    span = sw[1:][None, :] - sw[:-1][:, None]                     # weight of y[j..k]
    mean = (swy[1:][None, :] - swy[:-1][:, None]) / torch.where(k >= j, span, 1.0)
    mean = torch.where(k >= j, mean, _INF)                        # [j, k], k < j never taken
    suffix_min = torch.flip(torch.cummin(torch.flip(mean, [1]), 1).values, [1])  # min over k >= i
    return torch.where(j <= k, suffix_min, -_INF).amax(0)       # max over j <= i


@dataclasses.dataclass
class AcceptanceCalibrator:
    """rho -> the probability that a draft node is accepted, learnt online per model.

    edges:  ``[K + 1]`` float64 bin edges over rho, ascending (rho outside goes to the end bins).
    count:  ``[K]`` float64 draft nodes seen per bin.
    hits:   ``[K]`` float64 of them accepted.
    table:  ``[K]`` float64 the fitted acceptance per bin (the bin's mid rho until fitted).
    prior:  pseudo-observations per bin at the mid rho: the uncalibrated estimate acceptance =
            rho holds where little has been seen.

    :meth:`observe`, :meth:`fit` and :meth:`__call__` are device code without synchronisation
    that write only into these tensors, so a CUDA graph may replay them.
    """

    edges: Tensor
    count: Tensor
    hits: Tensor
    table: Tensor
    prior: float = 4.0

    def __post_init__(self) -> None:
        if not self.prior > 0:
            raise ValueError(f"prior must be > 0 (it keeps empty bins defined), got {self.prior}")
        if self.edges.dim() != 1 or self.count.shape != (self.edges.shape[0] - 1,):
            raise ValueError("edges must be [K + 1] and count, hits, table [K]")

    @classmethod
    def log_bins(cls, bins: int = 16, low: float = 1e-4, device=None,
                 prior: float = 4.0) -> "AcceptanceCalibrator":
        """``bins`` bins, the first ``[0, low)``, the rest log-spaced from ``low`` to 1."""
        inner = torch.logspace(math.log10(low), 0.0, bins, dtype=torch.float64, device=device)
        edges = torch.cat([torch.zeros(1, dtype=torch.float64, device=device), inner])
        zeros = torch.zeros(bins, dtype=torch.float64, device=device)
        return cls(edges, zeros.clone(), zeros.clone(), cls._mids(edges), prior)

    @staticmethod
    def _mids(edges: Tensor) -> Tensor:
        return 0.5 * (edges[1:] + edges[:-1])

    def bin_of(self, rho: Tensor) -> Tensor:
        """Bin index of every rho (clamped to the end bins)."""
        rho = rho.to(self.edges.dtype)
        return (torch.bucketize(rho, self.edges, right=True) - 1).clamp(0, self.count.shape[0] - 1)

    def observe(self, rho: Tensor, accepted: Tensor, mask: Tensor | None = None) -> None:
        """Count draft nodes of score ``rho`` and whether each was accepted (on the accepted
        path); ``mask`` leaves out roots and padding. Any matching shapes."""
        weight = torch.ones_like(rho, dtype=torch.float64) if mask is None else mask.double()
        index = self.bin_of(rho).reshape(-1)
        self.count.scatter_add_(0, index, weight.reshape(-1))
        self.hits.scatter_add_(0, index, (accepted.double() * weight).reshape(-1))

    def fit(self) -> Tensor:
        """Refit ``table`` in place from the counts: per-bin rates with the prior, made
        non-decreasing in rho, weighted by the observations (:func:`isotonic_fit_device`). Device
        code without synchronisation (a CUDA graph may replay it); returns the table."""
        mids = self._mids(self.edges)
        weight = self.count + self.prior
        rate = (self.hits + self.prior * mids) / weight
        self.table.copy_(isotonic_fit_device(rate, weight))
        return self.table

    def __call__(self, rho: Tensor) -> Tensor:
        """The fitted acceptance of every rho (same shape, float64)."""
        return self.table.gather(0, self.bin_of(rho).reshape(-1)).view(rho.shape)


#: every model's acceptance estimates per drafter, shared by its round runners in this process
_LEARNT: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def learnt_acceptance(model, drafter: tuple, device) -> AcceptanceCalibrator:
    """The acceptance estimates of ``model`` drafting with ``drafter`` (a key such as
    ``(drafter kind, acceptance profile, draft vocabulary)``) on ``device``: one
    :class:`AcceptanceCalibrator` per model and drafter in this process, so that an engine
    starts from what earlier engines of the same model learnt (acceptance per rho is a property
    of the model and its drafter, not of a batch or an engine). Runners that share it must not
    run rounds concurrently (they write the same counts)."""
    per_model = _LEARNT.setdefault(model, {})
    key = (tuple(drafter), str(torch.device(device)))
    if key not in per_model:
        per_model[key] = AcceptanceCalibrator.log_bins(device=device)
    return per_model[key]


def saved_acceptance(model) -> dict:
    """A copy of what engines of ``model`` learnt (:func:`learnt_acceptance`), per drafter, for
    :func:`restore_acceptance`."""
    return {key: _copy(cal) for key, cal in _LEARNT.get(model, {}).items()}


def restore_acceptance(model, saved: dict) -> None:
    """Make ``saved`` (:func:`saved_acceptance`) what the next engines of ``model`` start from
    (a copy: their rounds do not change ``saved``)."""
    _LEARNT[model] = {key: _copy(cal) for key, cal in saved.items()}


def _copy(cal: AcceptanceCalibrator) -> AcceptanceCalibrator:
    return dataclasses.replace(cal, edges=cal.edges.clone(), count=cal.count.clone(),
                               hits=cal.hits.clone(), table=cal.table.clone())


def forget_acceptance(model) -> None:
    """Drop what engines of ``model`` learnt (:func:`learnt_acceptance`): the next engine
    starts from the prior, as in a fresh process (benchmarks that compare runs use it so that
    a run does not depend on which ran before it)."""
    _LEARNT.pop(model, None)
