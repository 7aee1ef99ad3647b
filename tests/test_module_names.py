"""No module of the repository can be shadowed by, or shadow, an installed package.

A module of ours reached by a bare name (``import kernels`` with bench/ on sys.path) collides with
any installed distribution that ships the same top-level name: which one Python imports then
depends on test order. So: every name the repository puts on sys.path is free in this
environment, and bench's modules are only ever imported through the ``bench`` package.
"""

from __future__ import annotations

import ast
import importlib.metadata
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT_DIRS = ("train",)              # run by path, so their own folder lands on sys.path
PACKAGE_DIRS = ("bench", "bench/tuning")   # packages whose scripts drop their folder from sys.path


def top_level_names() -> dict[str, Path]:
    """Each importable top-level name the repository provides -> where it lives."""
    names = {p.name: p for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    names.update({p.stem: p for p in ROOT.glob("*.py")})
    for d in SCRIPT_DIRS:
        names.update({p.stem: p for p in (ROOT / d).glob("*.py")})
    return names


def test_no_repository_module_shares_a_name_with_an_installed_package():
    installed = {name: dists for name, dists in importlib.metadata.packages_distributions().items()
                 if set(dists) != {"bole"}}
    clashes = {name: (str(path.relative_to(ROOT)), installed[name])
               for name, path in top_level_names().items() if name in installed}
    clashes.update({name: (str(path.relative_to(ROOT)), "the standard library")
                    for name, path in top_level_names().items() if name in sys.stdlib_module_names})
    assert not clashes, f"rename these modules, or move them into a package: {clashes}"


def bench_module_names() -> set[str]:
    return {p.stem for d in PACKAGE_DIRS for p in (ROOT / d).glob("*.py") if p.stem != "__init__"}


def bare_imports(path: Path, names: set[str]) -> list[str]:
    """Imports in ``path`` that reach one of ``names`` as a top-level module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in names:
                found.append(node.module)
    return found


def test_bench_modules_are_imported_through_the_bench_package():
    names = bench_module_names()
    offenders = {}
    for path in ROOT.rglob("*.py"):
        if any(part in {".git", "mutants", "build"} or part.startswith(".") for part in
               path.relative_to(ROOT).parts):
            continue
        found = bare_imports(path, names)
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert not offenders, f"import these as bench.<name>: {offenders}"


def test_bench_scripts_drop_their_folder_from_sys_path():
    """Run by path (``python bench/e2e.py``), Python puts the script's folder first on sys.path;
    each bench script that imports anything of the repository takes it out again."""
    missing = []
    for d in PACKAGE_DIRS:
        for path in (ROOT / d).glob("*.py"):
            ours = bare_imports(path, {"bole", "bench", "tests"})
            if path.stem != "__init__" and ours and "sys.path[:] = [str(ROOT)]" not in path.read_text():
                missing.append(str(path.relative_to(ROOT)))
    assert not missing, missing


def test_detector_finds_a_bare_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import kernels as kb\nfrom serve import x\nfrom bench.harness import y\n")
    assert bare_imports(probe, {"kernels", "serve", "harness"}) == ["kernels", "serve"]
