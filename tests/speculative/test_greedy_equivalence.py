"""Greedy speculative decoding over the runtime equals plain greedy decoding, token for token.

Draft trees mix the true continuation (so long paths get accepted) with random tokens (so misses
happen at every depth); the GDN state, conv state and KV cache go through the factored commit.
"""

import numpy as np
import pytest
import torch

from bole.engine.runner import ModelRunner
from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel
from bole.speculative.accept import accept_forest
from bole.sampling_params import SamplingParams
from bole.speculative.sampling import target_probs
from bole.tree import DraftTree, PackedForest

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def model():
    m = HybridModel.random(preset_config("tiny"), dtype=torch.float32, seed=5, gdn_backend="torch")
    # sharpen the random model so its greedy choices are far from ties
    m.w["lm_head.weight"] = m.w["lm_head.weight"] * 50
    return m


def ar_greedy(model, prompt, n):
    """Plain decoding on the serial reference recurrence (an independent GDN path)."""
    runner = ModelRunner(model, model.new_cache(1, 128), "torch-serial")
    slot = runner.cache.allocate(len(prompt) + n)
    logits, _ = runner.prefill(slot, prompt)
    out = []
    for _ in range(n):
        tok = int(logits.argmax())
        out.append(tok)
        logits = runner.decode([slot], torch.tensor([tok]))[0]
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculative_greedy_equals_autoregressive(model, seed):
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 128, (9,), generator=gen)
    n = 30
    truth = ar_greedy(model, prompt, n + 10)
    runner = ModelRunner(model, model.new_cache(1, 128), "torch")
    slot = runner.cache.allocate(len(prompt) + n + 20)
    emitted = [int(runner.prefill(slot, prompt)[0].argmax())]
    rounds = 0
    while len(emitted) < n:
        tree = DraftTree.random(int(rng.integers(1, 12)), int(rng.integers(1, 5)), rng)
        tokens = torch.randint(0, 128, (tree.num_nodes,), generator=gen)
        tokens[0] = emitted[-1]
        node, d = 0, 0                      # the first-child chain carries the true continuation
        while True:
            kids = tree.children(node).tolist()
            if not kids or len(emitted) + d >= len(truth):
                break
            node, d = kids[0], d + 1
            if rng.random() < 0.8:
                tokens[node] = truth[len(emitted) - 1 + d]
        forest = PackedForest.pack([tree])
        batch, out = runner.verify([slot], forest, tokens)
        acc = accept_forest(target_probs(out.logits, GREEDY), tokens, forest)
        runner.commit_accepted(batch, out, acc.accepted)
        emitted += acc.new_tokens[0]
        rounds += 1
    assert emitted[:n] == truth[:n]
    assert rounds < n                        # speculation did accept something
