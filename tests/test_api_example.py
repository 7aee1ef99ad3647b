"""The documented Python API example runs as written.

The example is the ```python block of :mod:`bole.llm`'s docstring; the README carries the same
block (checked here when the README has one), so neither can drift from what works.
"""

import contextlib
import io
import re
from pathlib import Path

import pytest

import bole.llm

README = Path(__file__).resolve().parents[1] / "README.md"
FENCED = re.compile(r"```python\n(.*?)```", re.S)


def documented_example() -> str:
    """The first ```python block of bole/llm.py's module docstring."""
    blocks = FENCED.findall(bole.llm.__doc__)
    assert blocks, "bole/llm.py's docstring lost its ```python example"
    return blocks[0]


def test_readme_example_is_the_docstring_example():
    if not README.is_file():
        pytest.skip("no README.md next to the package (an installed copy)")
    api_blocks = [b for b in FENCED.findall(README.read_text()) if "from bole import LLM" in b]
    if not api_blocks:
        pytest.skip("README.md has no Python API example yet")
    assert api_blocks[0] == documented_example()


def test_api_example_runs_verbatim():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(documented_example(), "<README API example>", "exec"), {})
    printed = out.getvalue()
    # one text and one statistics line per prompt
    assert printed.startswith("def fib(n):") and "class Stack:" in printed
    stats = re.findall(r"\[(\d+) tokens, ([0-9.]+) per round, finish: (length|stop)\]", printed)
    assert len(stats) == 2
    assert all(1 <= int(n) <= 32 and float(mat) > 1 for n, mat, _ in stats)
