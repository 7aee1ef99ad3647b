"""Files shipped inside the package: the bundled model and its code prompts."""

from __future__ import annotations

import json
from pathlib import Path

BUNDLED_MODEL = Path(__file__).with_name("bundled")
"""The small Qwen3.5-architecture hybrid with an MTP head trained on the standard library
(train/bundled_model.py; model card: bole/bundled/README.md). Default model of the CLI."""


def code_prompts() -> list[str]:
    """Python prompts (signature + docstring) for demos and ``bole bench`` on a real tokenizer."""
    return json.loads((BUNDLED_MODEL / "prompts.json").read_text())
