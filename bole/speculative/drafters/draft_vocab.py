"""A reduced draft vocabulary: the MTP head proposes only the ``size`` most frequent tokens.

Each MTP step multiplies its output by the LM head, which at Qwen3.5's 248k-token vocabulary is
about 2 GB of bf16 weights: eight steps read it eight times, as much as the target's whole verify
forward. EAGLE-3 drafts over the 32k most frequent tokens instead. Here the head keeps a copy of
the LM head's rows of those tokens (``[size, hidden]``) and maps its top-k back to token ids;
verification keeps the target's full vocabulary, so output is unchanged (greedy output still
equals plain decoding's); only the proposals, and with them acceptance, can change.

Token frequencies come from ``token_counts.json`` in the checkpoint folder (``{"counts": [V
ints], "source": "..."}``, written by ``train/draft_vocab.py``). A model with random weights (the
benchmark presets) has no text to count: it takes ids 0 .. size - 1, which costs the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["COUNTS_FILE", "draft_vocab_ids", "frequent_ids", "load_counts"]

COUNTS_FILE = "token_counts.json"


def frequent_ids(counts: torch.Tensor, size: int) -> torch.Tensor:
    """``[size]`` int64 ids of the ``size`` largest ``counts [V]`` (ties: the lower id), in
    ascending id order."""
    V = counts.numel()
    if not 1 <= size <= V:
        raise ValueError(f"a draft vocabulary holds 1 to {V} tokens, got {size}")
    # stable descending sort: equal counts keep id order
    order = torch.sort(counts.to(torch.int64), descending=True, stable=True).indices
    return torch.sort(order[:size]).values


def load_counts(folder: Path, vocab_size: int) -> torch.Tensor:
    """``[vocab_size]`` int64 token counts from ``folder/token_counts.json``."""
    path = Path(folder) / COUNTS_FILE
    if not path.is_file():
        raise ValueError(
            f"--draft-vocab needs token frequencies, and {path} does not exist: count tokens of "
            f"text like the model's with `python train/draft_vocab.py --model {folder} "
            f"--corpus FILES...`, or leave --draft-vocab at 0 (the full vocabulary)")
    try:
        counts = json.loads(path.read_text())["counts"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a token-count file ({{\"counts\": [...]}}): {e}") from e
    if len(counts) != vocab_size or any(not isinstance(c, int) or c < 0 for c in counts):
        raise ValueError(f"{path} must hold {vocab_size} non-negative integer counts (one per "
                         f"token of the model's vocabulary), got {len(counts)} entries")
    return torch.tensor(counts, dtype=torch.int64)


def draft_vocab_ids(model, size: int) -> torch.Tensor | None:
    """The ids the MTP head drafts over, on the model's device; None for the full vocabulary
    (``size`` 0 or at least the vocabulary)."""
    V = model.config.vocab_size
    if size < 0:
        raise ValueError(f"draft_vocab must be >= 0 (0: the full vocabulary), got {size}")
    if size == 0 or size >= V:
        return None
    if model.tp.world > 1:
        raise ValueError("a reduced draft vocabulary is not supported with tensor parallelism "
                         "(the LM head is split by vocabulary range); use --draft-vocab 0")
    if model.folder is None:
        ids = torch.arange(size, dtype=torch.int64)        # random weights: any rows cost alike
    else:
        ids = frequent_ids(load_counts(model.folder, V), size)
    return ids.to(model.device)
