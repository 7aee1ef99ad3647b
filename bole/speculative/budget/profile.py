"""Hardware calibration of the verification budget: the profile one GPU measured.

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
``time_fn(batch, nodes) -> ms``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from bole.speculative.budget.widths import width_capacity

__all__ = ["FORMAT", "TimeFn", "cache_dir", "config_hash", "runtime_versions", "gpu_name",
           "dtype_name", "profile_path", "ProfileFormatError", "BudgetProfile", "find_profile",
           "b_ver_from_curve", "calibrate", "verification_budget", "plot_profile"]

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
