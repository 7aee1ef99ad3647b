"""Loading the repository's scripts (``bench/*.py``, ``train/*.py``) as modules in tests: they are
files run by path, not an installed package."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(path: str, name: str | None = None, *, register: bool = False) -> ModuleType:
    """The module of ``ROOT / path`` (e.g. ``"bench/budget.py"``), executed fresh, named ``name``
    (default: the file's stem). ``register`` puts it into ``sys.modules`` under that name before
    it runs (what its pickled objects or ``import name`` elsewhere need), and reuses a module
    already registered there."""
    name = name or Path(path).stem
    if register and name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
