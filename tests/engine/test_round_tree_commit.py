"""A tree round's commit moves the accepted path's KV rows to their final positions: the
target drafting for itself in a tree (top-2 at each level) accepts its top-1 path whole, whose
nodes after the first child sit at tree slots past their depth (level 2's first node is slot 3,
not 2). Committing them in place would leave the attention layer reading the wrong rows: the
tokens would stop equalling plain decoding."""

from __future__ import annotations

import torch

from bole.engine import Engine, SamplingParams, SpecConfig
from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]


def test_the_target_drafting_for_itself_in_a_tree_equals_plain_decoding():
    target = HybridModel.random(preset_config("tiny"), dtype=torch.float32, seed=1,
                                gdn_backend="torch")
    target.w["lm_head.weight"] = target.w["lm_head.weight"] * 50      # clear greedy margins
    draft = HybridModel(target.config, dict(target.w), gdn_backend="torch")
    params = SamplingParams(max_tokens=16)
    ar = Engine(target, SpecConfig(mode="ar")).generate(PROMPTS, params)
    res = Engine(target, SpecConfig(mode="bole", drafter="draft", depth=4, topk=2, budget=12),
                 draft_model=draft).generate(PROMPTS, params)
    assert [r.token_ids for r in res] == [r.token_ids for r in ar]
    # the whole top-1 path is accepted every round: depth + 1 tokens (1 + 3 x 5 = 16)
    assert all(a == 5 for r in res for a in r.accepted), [r.accepted for r in res]
