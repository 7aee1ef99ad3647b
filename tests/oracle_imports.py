"""transformers as the test oracle on its torch code paths.

transformers' Qwen3.5 / Qwen3-Next modules import fla and causal_conv1d when they are installed and
then run those GPU kernels instead of their torch reference code. The oracle tests block both
(``None`` in ``sys.modules`` makes ``import fla`` fail) before transformers is imported, once for
the whole process; the tests of Bole's own fla prefill lift the block for their duration
(:func:`fla_unblocked`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

FAST_KERNEL_MODULES = ("fla", "causal_conv1d")


def block_fast_kernels() -> None:
    """Make ``import fla`` / ``import causal_conv1d`` fail from now on (a module already imported
    stays); call at a test module's import, before transformers."""
    for name in FAST_KERNEL_MODULES:
        sys.modules.setdefault(name, None)


@contextmanager
def fla_unblocked() -> Iterator[None]:
    """The real fla for the duration, if :func:`block_fast_kernels` blocked it; after, the block
    is back and fla's modules imported meanwhile are gone: left in, ``from fla.ops... import``
    finds a submodule without its parent, and a later model would pick fla's prefill up."""
    blocked = "fla" in sys.modules and sys.modules["fla"] is None
    if not blocked:
        yield
        return
    del sys.modules["fla"]
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n.startswith("fla.")]:
            del sys.modules[name]
        sys.modules["fla"] = None
