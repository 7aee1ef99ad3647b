"""Benchmarks shipped with the package: modes.py (``bole bench``, every mode side by side on
one engine) and loadgen.py (``bole bench-serve``, a load generator for OpenAI-compatible
servers). The repository's bench/ holds the study's scripts."""
