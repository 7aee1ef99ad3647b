"""The ``bole`` command line: main.py (dispatch, tensor-parallel ranks), parser.py (every
command's options), common.py (argument checks and loaders), and one module per command that
needs more than a few lines (generate.py, bench.py, serve.py)."""

from bole.cli.main import main

__all__ = ["main"]
