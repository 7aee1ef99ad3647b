"""The round on a GPU: graph replay equals eager execution token for token, and a round makes no
host synchronisation but its one wait for the emitted tokens (GPU only; the CPU suite runs the
same device code eagerly in tests/test_engine.py and tests/speculative/)."""

import pytest
import torch

from bole.assets import BUNDLED_MODEL, code_prompts
from bole.engine import Engine, SamplingParams, SpecConfig
from bole.models.qwen3_hybrid import HybridModel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.fixture(scope="module")
def bundled():
    from tokenizers import Tokenizer
    model = HybridModel.from_pretrained(BUNDLED_MODEL, dtype=torch.float32, device="cuda")
    tok = Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    return model, [tok.encode(p).ids for p in code_prompts()[:3]]


CASES = [("ar", "mtp"), ("bole", "mtp"), ("tree-serial", "mtp"), ("chain", "mtp"),
         ("bole", "ngram")]


@pytest.mark.parametrize("mode,drafter", CASES)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_captured_rounds_equal_eager_rounds(bundled, mode, drafter, temperature):
    model, prompts = bundled
    params = SamplingParams(temperature=temperature, max_tokens=40, ignore_eos=True)
    outputs = []
    for graphs in (False, True):
        engine = Engine(model, SpecConfig(mode, drafter, depth=6, topk=3, budget=16),
                        max_slots=4, max_len=512, cuda_graphs=graphs)
        res = engine.generate(prompts, params, seed=11)
        outputs.append([r.token_ids for r in res])
        stats = engine.rounds.graphs.stats
        if graphs:
            assert stats["graph_replays"] > 0 and stats["eager_fallbacks"] == 0
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("prelaunch", [False, True])
@pytest.mark.parametrize("mode,drafter", CASES)
def test_a_round_synchronises_once(bundled, mode, drafter, prelaunch):
    model, prompts = bundled
    engine = Engine(model, SpecConfig(mode, drafter, depth=6, topk=3, budget=16), max_slots=4,
                    max_len=512)
    reqs = []
    for i, p in enumerate(prompts):
        r = engine.new_request(i, p, SamplingParams(max_tokens=64, ignore_eos=True, seed=i))
        engine.admit(r)
        reqs.append(r)
    engine.step(reqs)                           # buffers written for this batch
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            engine.step(reqs, prelaunch=prelaunch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert engine.timings.syncs == engine.timings.rounds
    for r in reqs:
        engine.release(r)


@pytest.mark.parametrize("policy,shared,width_kernel", [("global", 20, "0"), ("fixed", 0, "0"),
                                                       ("goodput", 0, "0"), ("goodput", 0, "1"),
                                                       ("calibrated", 0, "1")])
def test_every_width_is_captured_at_start_up(bundled, policy, shared, width_kernel, monkeypatch):
    """A shared budget changes the verify width and the kind of round (select, whole, plain)
    from round to round: each one's graphs exist before the first round, so no round captures
    (and output still equals the eager one; goodput also with its width choice in Triton)."""
    from bole.speculative.budget.profile import BudgetProfile  # B_ver 16 at batch 4: width 8
    monkeypatch.setenv("BOLE_WIDTH_KERNEL", width_kernel)
    model, prompts = bundled
    spec = SpecConfig("bole", "mtp", depth=6, topk=3, budget=16, budget_policy=policy,
                      shared_budget=shared)
    grid = [1, 4, 16, 64]                       # verify time rising steeply: goodput selects
    profile = BudgetProfile(gpu="test", config_hash="x", dtype="bfloat16", torch_version="",
                            triton_version="", eps=0.1, batches=[1, 2, 4], node_grid=grid,
                            t_dec=[1.0] * 3, t_ver=[[1.0 + i for i in range(len(grid))]] * 3,
                            b_ver=[16] * 3, t_select=[0.1] * 3, tree_nodes=16, model="bundled",
                            created="")
    outputs = []
    for graphs in (False, True):
        engine = Engine(model, spec, max_slots=4, max_len=512, cuda_graphs=graphs,
                        budget_profile=profile if policy in ("goodput", "calibrated") else None)
        before = set(engine.rounds.graphs.graphs)
        res = engine.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True), seed=3)
        outputs.append([r.token_ids for r in res])
        if graphs:
            assert set(engine.rounds.graphs.graphs) == before
            assert engine.rounds.graphs.stats["eager_fallbacks"] == 0
    assert outputs[0] == outputs[1]
