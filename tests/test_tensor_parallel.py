"""Tensor parallelism on the CPU: two gloo processes (spawned by the test, always joined) give
the single-process logits and, in every mode, the same greedy tokens; each rank loads only its
slices; counts that do not divide give clear errors."""

import pytest
import torch
import torch.multiprocessing as mp

from bole.assets import BUNDLED_MODEL, code_prompts
from bole.distributed import TPShard, free_port, init, shutdown
from bole.engine import Engine, SamplingParams, SpecConfig
from bole.engine.runner import ModelRunner
from bole.models.config import HybridConfig
from bole.models.loader import load_checkpoint
from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel
from bole.models.sharding import check_divisible, shard_plan, take

MODES = [("ar", "mtp"), ("bole", "mtp"), ("tree-serial", "mtp"), ("chain", "mtp"),
         ("bole", "ngram")]


def build(case: str, tp=None) -> tuple[HybridModel, list[list[int]]]:
    if case == "tiny":
        m = HybridModel.random(preset_config("tiny"), dtype=torch.float32, seed=3, mtp=True,
                               gdn_backend="torch", tp=tp)
        return m, [[5, 9, 17, 33, 2] * 4, [7, 7, 8, 9, 1, 2, 3, 7, 7, 8], [100]]
    from tokenizers import Tokenizer
    m = HybridModel.from_pretrained(BUNDLED_MODEL, dtype=torch.float32, gdn_backend="torch", tp=tp)
    tok = Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    return m, [tok.encode(p).ids for p in code_prompts()[:2]]


def run(model: HybridModel, prompts) -> dict:
    runner = ModelRunner(model, model.new_cache(1, 128), "torch")
    slot = runner.cache.allocate(100)
    _, hidden = runner.prefill(slot, torch.tensor(prompts[0]))
    out = {"logits": model.lm_head(hidden)}
    for mode, drafter in MODES:
        engine = Engine(model, SpecConfig(mode, drafter, depth=4, topk=3, budget=12),
                        max_slots=len(prompts), max_len=256)
        out[(mode, drafter)] = [r.token_ids for r in engine.generate(
            prompts, SamplingParams(max_tokens=16, ignore_eos=True), seed=0)]
    return out


def _worker(rank: int, world: int, port: int, case: str, path: str) -> None:
    tp = init(rank, world, port)
    try:
        model, prompts = build(case, tp)
        result = run(model, prompts)
        if rank == 0:
            torch.save(result, path)
    finally:
        shutdown(meet=True)


@pytest.mark.parametrize("case", ["tiny", "bundled"])
def test_two_ranks_equal_one(case, tmp_path):
    path = str(tmp_path / "tp2.pt")
    mp.spawn(_worker, args=(2, free_port(), case, path), nprocs=2, join=True)
    tp2 = torch.load(path)
    tp1 = run(*build(case))
    a, b = tp2.pop("logits"), tp1.pop("logits")
    assert float((a - b).abs().max() / b.abs().max()) < 1e-5
    for key in tp1:
        assert tp2[key] == tp1[key], key


def test_each_rank_loads_only_its_slices():
    config = HybridConfig.from_pretrained(BUNDLED_MODEL)
    full, _ = load_checkpoint(BUNDLED_MODEL, config, dtype=torch.float32)
    for rank in (0, 1):
        shard = TPShard(rank, 2)
        part, _ = load_checkpoint(BUNDLED_MODEL, config, dtype=torch.float32, shard=shard)
        sliced = 0
        for name, t in part.items():
            plan = shard_plan(config, name, shard)
            assert torch.equal(t, take(full[name], plan)), name
            sliced += plan is not None
        assert sliced > 40 and part["model.embed_tokens.weight"].shape[0] == config.vocab_size // 2


def test_counts_that_tp_does_not_divide_are_clear_errors():
    config = preset_config("tiny")                    # 4 attention heads, 2 key-value heads
    with pytest.raises(ValueError, match=r"tp=3 does not divide .*attention heads \(4\)"):
        check_divisible(config, 3)
    with pytest.raises(ValueError, match=r"key-value heads \(2\)"):
        check_divisible(config, 4)
    with pytest.raises(ValueError, match="tp must be >= 1"):
        check_divisible(config, 0)


def test_cli_generate_with_two_ranks(capfd):
    """The ranks are processes of their own: their output is read at the file descriptors."""
    import json

    from bole.cli import main
    base = ["generate", "--prompt", "def fib(n):", "--max-tokens", "12", "--device", "cpu",
            "--json"]
    assert main(base) == 0
    one = json.loads(capfd.readouterr().out)
    assert main(base + ["--tp", "2"]) == 0
    out = capfd.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert len(lines) == 1 and json.loads(lines[0])["token_ids"] == one["token_ids"]
    assert main(base + ["--tp", "3"]) == 2                 # 4 heads, 2 key-value heads
    assert "does not divide" in capfd.readouterr().err


def test_ranks_meet_before_leaving_unless_an_exception_unwinds(monkeypatch):
    """shutdown(meet=True) waits at a barrier on a clean exit (no rank tears its connections
    down under another), not while an exception unwinds; shutdown() never does."""
    import torch.distributed as dist

    from bole import distributed
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append("destroy"))
    distributed.shutdown(meet=True)
    assert calls == ["barrier", "destroy"]
    calls.clear()
    with pytest.raises(RuntimeError):
        try:
            raise RuntimeError("a rank failed")
        finally:
            distributed.shutdown(meet=True)
    assert calls == ["destroy"]
    calls.clear()
    distributed.shutdown()
    assert calls == ["destroy"]
