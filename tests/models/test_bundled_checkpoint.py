"""The shipped bundled checkpoint: loads through Bole's loader and through transformers' Qwen3.5
classes, with equal logits; carries its MTP head and tokenizer; is the CLI's default model."""

import pytest
import torch

from tests.oracle_imports import block_fast_kernels

block_fast_kernels()  # transformers on its torch paths (tests/oracle_imports.py)
pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from bole.assets import BUNDLED_MODEL, code_prompts  # noqa: E402
from bole.models.qwen3_hybrid import HybridModel  # noqa: E402


@pytest.fixture(scope="module")
def models():
    from transformers import Qwen3_5ForCausalLM
    hf = Qwen3_5ForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32).eval()
    ours = HybridModel.from_pretrained(BUNDLED_MODEL, dtype=torch.float32)
    tok = tokenizers.Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    return hf, ours, tok


def test_size_and_files():
    files = [p for p in BUNDLED_MODEL.iterdir() if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 30 * 10**6
    assert all(p.stat().st_size <= 16 * 2**20 for p in files)
    names = {p.name for p in files}
    assert {"config.json", "tokenizer.json", "model.safetensors.index.json", "mtp.safetensors",
            "README.md", "train_log.json", "prompts.json"} <= names


def test_transformers_and_bole_logits_agree(models):
    hf, ours, tok = models
    ids = tok.encode(code_prompts()[0]).ids
    assert tok.decode(ids) == code_prompts()[0]
    assert "mtp.fc.weight" in ours.w
    with torch.no_grad():
        hf_logits = hf(input_ids=torch.tensor([ids])).logits[0]
        from bole.engine.runner import ModelRunner
        runner = ModelRunner(ours, ours.new_cache(1, 128), "torch")
        slot = runner.cache.allocate(len(ids) + 16)
        _, hidden = runner.prefill(slot, torch.tensor(ids))
        logits = ours.lm_head(hidden)
        assert torch.allclose(logits, hf_logits, atol=1e-4, rtol=1e-4)
        # greedy decode steps agree with transformers on the growing sequence
        seq = list(ids)
        nxt = int(logits[-1].argmax())
        for _ in range(8):
            seq.append(nxt)
            step = runner.decode([slot], torch.tensor([nxt]))[0]
            ref = hf(input_ids=torch.tensor([seq])).logits[0, -1]
            assert torch.allclose(step, ref, atol=1e-4, rtol=1e-4)
            nxt = int(step.argmax())


def test_cli_defaults_to_the_bundled_model():
    from bole.cli.parser import build_parser
    args = build_parser().parse_args(["generate", "--prompt", "x"])
    assert args.model == str(BUNDLED_MODEL)


@pytest.mark.parametrize("drafter", ["mtp", "ngram", "draft"])
def test_greedy_output_equals_plain_decoding_in_every_mode(models, drafter):
    from bole.engine import Engine, SamplingParams, SpecConfig
    _, ours, tok = models
    prompts = [tok.encode(p).ids for p in code_prompts()[:3]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outputs = {}
    for mode in ("ar", "bole", "tree-serial", "chain"):
        engine = Engine(ours, SpecConfig(mode, drafter, depth=6, topk=3, budget=16), max_slots=3,
                        max_len=128, draft_model=ours if drafter == "draft" else None)
        results = engine.generate(prompts, params)
        outputs[mode] = [r.token_ids for r in results]
        if mode != "ar" and drafter != "ngram":
            assert sum(r.mean_accepted_tokens for r in results) / 3 > 1.5
    assert all(outputs[m] == outputs["ar"] for m in outputs)
