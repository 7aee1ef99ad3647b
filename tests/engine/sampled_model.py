"""The model and prompt of the tests that compare a round's draws with the model's own softmax
(tests/engine/test_first_token.py, test_round_sampling.py)."""

from __future__ import annotations

import torch

from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel

PROMPT = [5, 9, 17, 33, 2] * 4


def peaked_tiny_model() -> HybridModel:
    """The tiny preset with logits scaled so that a few dozen tokens are likely."""
    m = HybridModel.random(preset_config("tiny"), dtype=torch.float32, seed=3, gdn_backend="torch")
    tensors = dict(m.w)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 8
    return HybridModel(m.config, tensors, gdn_backend="torch")
