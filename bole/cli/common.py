"""What every ``bole`` command shares: the usage error, the help format, and the checks and
loaders of arguments (device, checkpoint folder, tokenizer, prompt, model, speculative config)
that need nothing loaded before them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bole.assets import BUNDLED_MODEL

class UsageError(Exception):
    """A problem with the command's arguments or inputs: printed as one line, exit code 2."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default after its help, unless the default is None or False (nothing
    to show) or the help already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action)


def read_prompt(args) -> str | None:
    """The prompt of ``--prompt`` or ``--prompt-file`` (stdin for '-'), checked to be UTF-8."""
    source = args.prompt_file if args.prompt_file is not None else (
        "-" if args.prompt == "-" else None)
    if source is None:
        text = args.prompt
        if text is not None:
            bad = next((c for c in text if "\udc80" <= c <= "\udcff"), None)
            if bad is not None:             # an undecodable byte of the command line
                raise UsageError(f"--prompt is not UTF-8 text (byte 0x{ord(bad) - 0xdc00:02x} at "
                                 f"character {text.index(bad)}); pass the text in UTF-8, or "
                                 "--prompt-file with a UTF-8 file")
        return text
    where = "stdin" if source == "-" else source
    try:
        raw = sys.stdin.buffer.read() if source == "-" else Path(source).read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read the prompt from {where}: {exc.strerror or exc}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"the prompt in {where} is not UTF-8 text (byte 0x{raw[exc.start]:02x} "
                         f"at offset {exc.start}); convert it, e.g. iconv -t UTF-8") from None


def load_model(args, device: str, dtype, mtp: bool = False):
    """``(model, name, folder or None)`` of ``--model`` / ``--preset`` (a preset's random
    weights get an MTP head when ``mtp``)."""
    from bole.models.presets import PRESETS, preset_config
    from bole.models.qwen3_hybrid import HybridModel
    if args.preset:
        if args.preset.lower() not in PRESETS:
            raise UsageError(f"unknown preset {args.preset!r}; known: {', '.join(PRESETS)}")
        model = HybridModel.random(preset_config(args.preset), dtype=dtype, device=device,
                                   mtp=mtp, tp=getattr(args, "tp_group", None))
        return model, f"{args.preset}-random", None
    folder = checkpoint_folder(args.model or str(BUNDLED_MODEL), need_tokenizer=False)
    model = HybridModel.from_pretrained(folder, dtype=dtype, device=device,
                                        tp=getattr(args, "tp_group", None))
    name = "bundled" if folder.resolve() == BUNDLED_MODEL.resolve() else folder.name
    return model, name, folder


def pick_device(name: str | None) -> str:
    import torch
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UsageError(f"unknown device {name!r}; use cpu or cuda") from None
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"device {name!r} is not supported; use cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for a GPU, but this PyTorch sees none (no CUDA "
                         "build or no device); use --device cpu")
    return name


def checkpoint_folder(folder: str, need_tokenizer: bool) -> Path:
    path = Path(folder)
    if not path.exists():
        raise UsageError(f"the model folder {folder} does not exist; give a checkpoint folder "
                         "or leave --model out for the bundled model")
    if not path.is_dir():
        raise UsageError(f"--model {folder} is a file; give the checkpoint's folder")
    missing = [n for n in ("config.json",) + (("tokenizer.json",) if need_tokenizer else ())
               if not (path / n).is_file()]
    if missing:
        raise UsageError(f"{folder} is not a checkpoint folder: {', '.join(missing)} missing "
                         "(a Qwen3.5 / Qwen3-Next folder has config.json, *.safetensors and "
                         "tokenizer.json)")
    return path


def load_tokenizer(folder: Path):
    from tokenizers import Tokenizer
    file = folder / "tokenizer.json"
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:                     # tokenizers raises a bare Exception
        raise UsageError(f"{file} is not a readable tokenizer ({exc}); replace it with the "
                         "checkpoint's tokenizer.json") from None


def spec_from_args(args, drafter: str):
    from bole.engine import SpecConfig
    from bole.speculative.budget.registry import DEFAULT_POLICY
    spec = SpecConfig(args.mode if hasattr(args, "mode") else "bole", drafter, args.depth,
                      args.topk, args.budget, getattr(args, "acceptance", None),
                      getattr(args, "budget_policy", DEFAULT_POLICY),
                      getattr(args, "shared_budget", 0),
                      getattr(args, "root_floor", 1), getattr(args, "draft_vocab", 0),
                      budget_eps=getattr(args, "budget_eps", None))
    try:
        spec.validate()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return spec


def prefix_cache_from_args(args):
    """The engine's prefix cache: on unless ``--no-prefix-cache`` (and off under tensor
    parallelism, which it does not support yet), ``--prefix-cache-gib`` of device memory."""
    from bole.engine.prefix_admission import PrefixCacheConfig
    if not getattr(args, "prefix_cache", True) or getattr(args, "tp", 1) > 1:
        return None
    try:
        return PrefixCacheConfig(capacity_gib=getattr(args, "prefix_cache_gib", None))
    except ValueError as exc:
        raise UsageError(f"--prefix-cache-gib: {exc}") from None


def check_positive(**values) -> None:
    for name, v in values.items():
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")


def set_rank_device(args, rank: int) -> None:
    """A tensor-parallel rank's device: its own GPU (``cuda:rank``) or the CPU."""
    if pick_device(args.device).startswith("cuda"):
        args.device = f"cuda:{rank}"
