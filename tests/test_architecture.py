"""The package's shape: no import cycles, imports only downwards, short files and functions.

Read from the source with ``ast``; nothing of ``bole`` is imported. Every ``import`` statement
counts, also those inside functions and under ``TYPE_CHECKING``: a lazy import hides a
dependency, it does not remove it.

Layers, lowest first (a module may import its own layer and any layer below it):

1. base        -- ``assets``, ``config``, ``distributed``, ``memory``, ``sampling_params``,
   ``tree``
2. ops         -- ``bole.ops``: the kernels and their torch references
3. structures  -- ``forest``, ``cache``: batched trees and cache slots, built on ops' kernels
4. models      -- ``bole.models``
5. speculative -- ``bole.speculative``: drafters, acceptance, sampling, the budget
6. engine      -- ``bole.engine``
7. api         -- ``bole`` itself, ``llm``, ``bench``, ``demo``, ``generation_demo``
8. server      -- ``bole.server``
9. cli         -- ``bole.cli``, ``bole.__main__``

Every Triton kernel (a ``@triton.jit`` function) lives under ``bole/ops/``, which sits below
models and speculative, so no kernel can import their types. And no file under ``bole/`` is over
500 lines, no function over 80 lines (a ``@triton.jit``
kernel's body is exempt, its Python wrapper is not). The allowlists below name what is not yet
met; an entry that is no longer needed fails the test, so they can only shrink.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "bole"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("bole.assets", "bole.config", "bole.distributed", "bole.memory",
              "bole.sampling_params", "bole.tree")),
    ("ops", ("bole.ops",)),
    ("structures", ("bole.forest", "bole.cache")),
    ("models", ("bole.models",)),
    ("speculative", ("bole.speculative",)),
    ("engine", ("bole.engine",)),
    ("api", ("bole", "bole.llm", "bole.bench", "bole.demo", "bole.generation_demo")),
    ("server", ("bole.server",)),
    ("cli", ("bole.cli", "bole.__main__")),
]

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80

# (importer, imported) edges that close an import cycle, not yet broken
CYCLE_EDGES_ALLOWED: set[tuple[str, str]] = set()
# (importer, imported) edges from a lower layer to a higher one, not yet removed
UPWARD_EDGES_ALLOWED: set[tuple[str, str]] = set()
# files (relative to the repository) over MAX_FILE_LINES
LONG_FILES_ALLOWED: set[str] = set()
# "file::qualified.name" of functions over MAX_FUNCTION_LINES
LONG_FUNCTIONS_ALLOWED: set[str] = set()


def modules() -> dict[str, Path]:
    """Dotted module name -> its file, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _owner(name: str, mods: dict[str, Path]) -> str:
    """The module that defines ``name``: itself, or its longest prefix that is a module."""
    while name not in mods:
        name = name.rpartition(".")[0]
    return name


def imports_of(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` (at ``path``) imports, itself excepted."""
    found = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {_owner(a.name, mods) for a in node.names if a.name.split(".")[0] == "bole"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "bole":
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                found.add(full if full in mods else _owner(source, mods))
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, mods) for name, path in mods.items()}


def layer_of(name: str) -> int:
    """Index into LAYERS of the layer holding module ``name`` (its longest matching prefix)."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    assert best is not None, f"{name} is in no layer: add it to LAYERS"
    return best


def reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return False


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of modules, or None."""
    state: dict[str, int] = {}               # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def _is_triton_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for dec in fn.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if ast.unparse(target) in {"triton.jit", "jit"}:
            return True
    return False


def function_lengths(path: Path) -> dict[str, int]:
    """Qualified name -> line count (decorators excluded) of each function in ``path``."""
    lengths: dict[str, int] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if not _is_triton_kernel(child):
                    lengths[prefix + child.name] = child.end_lineno - child.lineno + 1
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(path.read_text(), str(path)), "")
    return lengths


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_every_module_is_in_a_layer():
    for name in modules():
        layer_of(name)


def test_no_import_cycles():
    graph = import_graph()
    stale = sorted(e for e in CYCLE_EDGES_ALLOWED
                   if e[1] not in graph.get(e[0], ()) or not reaches(graph, e[1], e[0]))
    assert not stale, f"edges that close no cycle any more: drop from CYCLE_EDGES_ALLOWED: {stale}"
    pruned = {a: {b for b in deps if (a, b) not in CYCLE_EDGES_ALLOWED}
              for a, deps in graph.items()}
    cycle = find_cycle(pruned)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_go_downwards():
    graph = import_graph()
    upward = {(a, b) for a, deps in graph.items() for b in deps if layer_of(b) > layer_of(a)}
    stale = sorted(UPWARD_EDGES_ALLOWED - upward)
    assert not stale, f"no longer imported upwards: drop them from UPWARD_EDGES_ALLOWED: {stale}"
    new = sorted(upward - UPWARD_EDGES_ALLOWED)
    assert not new, "imports from a lower layer to a higher one:\n" + "\n".join(
        f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})" for a, b in new)


def test_triton_kernels_live_under_ops():
    def has_kernel(path: Path) -> bool:
        return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_triton_kernel(n)
                   for n in ast.walk(ast.parse(path.read_text(), str(path))))

    outside = [_rel(p) for p in modules().values()
               if not _rel(p).startswith("bole/ops/") and has_kernel(p)]
    assert not outside, f"Triton kernels outside bole/ops/: {outside}"


def test_file_lengths():
    long = {_rel(p) for p in modules().values() if len(p.read_text().splitlines()) > MAX_FILE_LINES}
    stale = sorted(LONG_FILES_ALLOWED - long)
    assert not stale, f"no longer over {MAX_FILE_LINES} lines: drop from LONG_FILES_ALLOWED: " \
        f"{stale}"
    new = sorted(long - LONG_FILES_ALLOWED)
    assert not new, f"files over {MAX_FILE_LINES} lines: {new}"


def test_function_lengths():
    long = {f"{_rel(p)}::{fn}" for p in modules().values()
            for fn, n in function_lengths(p).items() if n > MAX_FUNCTION_LINES}
    stale = sorted(LONG_FUNCTIONS_ALLOWED - long)
    assert not stale, f"no longer over {MAX_FUNCTION_LINES} lines: drop from " \
        f"LONG_FUNCTIONS_ALLOWED: {stale}"
    new = sorted(long - LONG_FUNCTIONS_ALLOWED)
    assert not new, f"functions over {MAX_FUNCTION_LINES} lines: {new}"


def test_the_round_loop_is_short():
    """The round's ``run`` reads as plan in, phases, result out: at most 60 lines."""
    assert function_lengths(PACKAGE / "engine" / "round.py")["RoundRunner.run"] <= 60


def test_checks_catch_what_they_guard(tmp_path):
    """The detectors on a planted cycle, a relative import and a long non-kernel function."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    pkg = tmp_path / "bole" / "x"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .y import f\n")
    (pkg / "y.py").write_text("from ..z import g\nimport bole.x\n")
    mods = {"bole": tmp_path / "bole" / "__init__.py", "bole.x": pkg / "__init__.py",
            "bole.x.y": pkg / "y.py", "bole.z": tmp_path / "bole" / "z.py"}
    assert imports_of("bole.x", mods["bole.x"], mods) == {"bole.x.y"}
    assert imports_of("bole.x.y", mods["bole.x.y"], mods) == {"bole.z", "bole.x"}
    body = "\n".join(["    x = 1"] * MAX_FUNCTION_LINES)
    (pkg / "z.py").write_text(f"@triton.jit\ndef k():\n{body}\n\ndef w():\n{body}\n")
    assert function_lengths(pkg / "z.py") == {"w": MAX_FUNCTION_LINES + 1}
    assert layer_of("bole.ops.gdn.common") < layer_of("bole.engine.round") < layer_of("bole.cli")
