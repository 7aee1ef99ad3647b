"""Safetensors checkpoint loading by the checkpoint's own tensor names, with a clear report.

A checkpoint folder holds ``config.json`` and either ``model.safetensors`` or shards listed by
``model.safetensors.index.json``. :func:`load_checkpoint` reads the tensors that
:mod:`bole.models.weights` expects for the config, converts them to the requested dtype (gate
parameters stay fp32) and fails with one :class:`CheckpointError` that names every missing,
mis-shaped or unexpected tensor and the file it was looked for in; a truncated or corrupt file is
named too. FP8 checkpoints (``quantization_config`` with block scales): every weight stored with a
``<name>_scale_inv`` tensor is read as an :class:`~bole.ops.fp8.Fp8Weight` (FP8 values kept,
scales in fp32); the others in the requested dtype. The MTP head (``mtp.*``) is optional: loaded and checked when present. MoE experts are
read in the layout the checkpoint holds (per expert, or fused ``experts.gate_up_proj`` /
``experts.down_proj``: :mod:`bole.models.weights`); the model stacks per-expert tensors into the
fused layout once (:class:`bole.models.qwen3_hybrid.HybridModel`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from bole.distributed import TPShard
from bole.models.config import HybridConfig
from bole.models.sharding import shard_plan, zero_on_other_ranks
from bole.models.weights import (FP32_SUFFIXES, IGNORED_PREFIXES, SCALE_SUFFIX,
                                 has_fused_experts, mtp_specs, text_model_specs)
from bole.ops.fp8 import FP8_DTYPE, Fp8Weight

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message lists every problem found."""


@dataclass
class LoadReport:
    folder: str
    files: list[str] = field(default_factory=list)
    loaded: int = 0
    has_mtp: bool = False
    missing: list[str] = field(default_factory=list)
    mis_shaped: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    ignored: int = 0

    @property
    def problems(self) -> list[str]:
        return self.missing + self.mis_shaped + self.unexpected


def checkpoint_files(folder: str | Path) -> dict[str, str]:
    """Tensor name -> file name, from the index or the single file's header."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc!r})") from None
        for name, fname in weight_map.items():
            if not (folder / fname).is_file():
                raise CheckpointError(f"{index} maps {name} to {fname}, which is not in {folder}")
        return dict(weight_map)
    single = folder / SINGLE_FILE
    if single.is_file():
        with _open(single) as f:
            return {name: SINGLE_FILE for name in f.keys()}
    raise CheckpointError(
        f"{folder} holds neither {SINGLE_FILE} nor {INDEX_FILE}: not a safetensors checkpoint")


class _open:
    """safe_open that names the file when it is truncated or corrupt."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        try:
            self.handle = safe_open(str(self.path), framework="pt")
            return self.handle.__enter__()
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise CheckpointError(f"{self.path} is truncated or corrupt: {exc}") from None

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)


def _read(f, name: str, plan) -> torch.Tensor:
    """The whole tensor, or only the rows / columns of a shard's plan."""
    if plan is None:
        return f.get_tensor(name)
    dim, ranges = plan
    sl = f.get_slice(name)
    parts = [sl[a:b] if dim == 0 else sl[:, a:b] if dim == 1 else sl[:, :, a:b]
             for a, b in ranges]
    return torch.cat(parts, dim=dim).contiguous()


def load_checkpoint(folder: str | Path, config: HybridConfig | None = None, *,
                    dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                    load_mtp: bool = True,
                    shard: TPShard | None = None) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """Load every tensor the config expects. Returns ``(tensors by checkpoint name, report)``.
    With ``shard`` (tensor parallelism) each tensor's slice for that rank is all that is read
    (:func:`bole.models.sharding.shard_plan`).

    Raises :class:`CheckpointError` listing each missing, mis-shaped or unexpected tensor with its
    file, and for a truncated or corrupt file.
    """
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype must be bf16, fp16 or fp32, got {dtype}")
    folder = Path(folder)
    config = config or HybridConfig.from_pretrained(folder)
    if config.fp8_block is not None and shard is not None and shard.world > 1:
        raise CheckpointError(f"{folder} holds FP8 weights: tensor parallelism over FP8 "
                              "checkpoints is not supported yet; load it on one GPU (--tp 1)")
    where = checkpoint_files(folder)
    report = LoadReport(folder=str(folder), files=sorted(set(where.values())))
    expected, scales = _expected(folder, config, where, load_mtp, report)
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for name in expected:
        if name in where:
            by_file.setdefault(where[name], []).append(name)
    for fname, names in sorted(by_file.items()):
        with _open(folder / fname) as f:
            keys = set(f.keys())
            for name in names:
                t = _checked_read(f, folder, fname, name, keys, expected, config, shard, report)
                if t is None:
                    continue
                if name in scales:
                    if t.dtype != FP8_DTYPE:
                        report.mis_shaped.append(f"tensor {name} in {fname} has a scale "
                                                 f"{scales[name]} but is {t.dtype}, not "
                                                 f"{FP8_DTYPE}")
                        continue
                    tensors[name] = t.to(device=device)
                    continue
                if t.dtype == FP8_DTYPE:
                    report.mis_shaped.append(f"tensor {name} in {fname} is {t.dtype} without "
                                             f"a scale tensor {name}{SCALE_SUFFIX}")
                    continue
                keep32 = name.endswith(FP32_SUFFIXES)
                tensors[name] = t.to(device=device, dtype=torch.float32 if keep32 else dtype)
    _attach_scales(folder, where, scales, tensors, config, report, device)
    report.loaded = len(tensors)
    if report.problems:
        lines = "\n  ".join(report.problems[:50])
        more = f"\n  ... and {len(report.problems) - 50} more" if len(report.problems) > 50 else ""
        raise CheckpointError(
            f"checkpoint {folder} ({config.model_type}) does not match its config:\n  {lines}{more}")
    return tensors, report


def _expected(folder: Path, config: HybridConfig, where: dict[str, str], load_mtp: bool,
              report: LoadReport) -> tuple[dict, dict[str, str]]:
    """(expected shapes by name, FP8 scale name by weight name); records the unexpected,
    ignored and missing names in ``report``."""
    # the text model's and the MTP head's experts may come in different layouts
    present_mtp = [n for n in where if n.startswith("mtp.")]
    fused = has_fused_experts(n for n in where if not n.startswith("mtp."))
    expected = text_model_specs(config, fused_experts=fused)
    if load_mtp and present_mtp:
        layers = {int(n.split(".")[2]) for n in present_mtp if n.startswith("mtp.layers.")}
        expected.update(mtp_specs(config, num_layers=len(layers),
                                  fused_experts=has_fused_experts(present_mtp)))
        report.has_mtp = True
    scales = {n[: -len(SCALE_SUFFIX)]: n for n in where
              if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in expected}
    if config.fp8_block is None and scales:
        report.unexpected.append(f"FP8 scale tensors ({next(iter(scales.values()))}, ...) but "
                                 f"config.json has no quantization_config")
        scales = {}
    for name in sorted(where):
        if name in expected or name in scales.values():
            continue
        if name.startswith(IGNORED_PREFIXES) or (name.startswith("mtp.") and not load_mtp):
            report.ignored += 1
        else:
            report.unexpected.append(f"unexpected tensor {name} in {where[name]}")
    for name in expected:
        if name not in where:
            report.missing.append(f"missing tensor {name} (shape {list(expected[name])}): in no "
                                  f"file of {folder}")
    return expected, scales


def _checked_read(f, folder: Path, fname: str, name: str, keys: set, expected: dict,
                  config: HybridConfig, shard: TPShard | None,
                  report: LoadReport) -> torch.Tensor | None:
    """Tensor ``name`` of open file ``f`` (this rank's slice), or None with the problem in
    ``report`` (absent, mis-shaped)."""
    if name not in keys:
        report.missing.append(f"missing tensor {name}: the index maps it to {fname}, "
                              "which does not hold it")
        return None
    shape = tuple(f.get_slice(name).get_shape())
    if shape != expected[name]:
        report.mis_shaped.append(f"mis-shaped tensor {name} in {fname}: {list(shape)}, expected "
                                 f"{list(expected[name])}")
        return None
    try:
        t = _read(f, name, shard_plan(config, name, shard) if shard else None)
        if shard is not None and shard.rank and zero_on_other_ranks(name):
            t = torch.zeros_like(t)
    except (SafetensorError, RuntimeError) as exc:
        raise CheckpointError(
            f"{folder / fname} is truncated or corrupt at tensor {name}: {exc}") from None
    return t


def _attach_scales(folder: Path, where: dict[str, str], scales: dict[str, str],
                   tensors: dict, config: HybridConfig, report: LoadReport, device) -> None:
    """Replace each FP8 tensor read by the loader with an Fp8Weight of it and its scale."""
    by_file: dict[str, list[str]] = {}
    for name, scale_name in scales.items():
        if name in tensors:
            by_file.setdefault(where[scale_name], []).append(name)
    for fname, names in sorted(by_file.items()):
        with _open(folder / fname) as f:
            keys = set(f.keys())
            for name in names:
                if scales[name] not in keys:
                    report.missing.append(f"missing tensor {scales[name]}: the index maps it to "
                                          f"{fname}, which does not hold it")
                    del tensors[name]
                    continue
                try:
                    scale = f.get_tensor(scales[name]).to(device=device, dtype=torch.float32)
                    tensors[name] = Fp8Weight(tensors[name], scale, config.fp8_block)
                except ValueError as exc:            # the scale's shape does not fit the blocks
                    report.mis_shaped.append(f"{scales[name]} in {fname}: {exc}")
                    del tensors[name]
                except (SafetensorError, RuntimeError) as exc:
                    raise CheckpointError(f"{folder / fname} is truncated or corrupt at tensor "
                                          f"{scales[name]}: {exc}") from None
