"""Bole's benchmarks and their shared harness (``bench.harness``). A package, so that its modules
are always reached as ``bench.<name>``: run them as ``python bench/<name>.py`` or
``python -m bench.<name>`` from the repository root."""
