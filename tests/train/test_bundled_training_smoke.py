"""The bundled-model training script, smoke-run on CPU: its checkpoint loads in transformers and in
Bole with equal logits, and the trained MTP head means the same thing in training and in Bole's
drafter (same inputs, same positions, same logits)."""

import json
import math

import pytest
import torch

from tests.oracle_imports import block_fast_kernels
from tests.scripts import load_script

block_fast_kernels()  # transformers on its torch paths (tests/oracle_imports.py)
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    mod = load_script("train/bundled_model.py")
    out = tmp_path_factory.mktemp("bundled")
    assert mod.main(["--out", str(out), "--steps", "2", "--tiny", "--seq", "32", "--batch", "2"]) == 0
    return mod, out


def test_checkpoint_layout_and_log(trained):
    _, out = trained
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "tokenizer.json", "mtp.safetensors", "model.safetensors.index.json",
            "train_log.json"} <= names
    log = json.loads((out / "train_log.json").read_text())
    assert log["held_out_files"]
    # two steps from a small initialisation: the held-out loss is still that of a uniform guess
    # over the vocabulary, and the perplexity is its exponential
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    loss = log["eval"]["loss"]
    assert abs(loss - math.log(vocab)) < 0.5, (loss, vocab)
    assert log["eval"]["perplexity"] == pytest.approx(math.exp(loss), rel=1e-9)


def test_transformers_and_bole_agree_and_mtp_means_the_same(trained):
    from transformers import Qwen3_5ForCausalLM

    from bole.models.qwen3_hybrid import HybridModel
    from bole.speculative.drafters.mtp import MTPDrafter
    mod, out = trained
    hf = Qwen3_5ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = HybridModel.from_pretrained(out, dtype=torch.float32)
    assert "mtp.fc.weight" in ours.w
    ids = torch.randint(0, ours.config.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf_out = hf.model(input_ids=ids[None])
        hf_logits = hf.lm_head(hf_out.last_hidden_state)[0]
    from bole.engine.runner import ModelRunner
    runner = ModelRunner(ours, ours.new_cache(1, 64), "torch")
    slot = runner.cache.allocate(32)
    _, hidden = runner.prefill(slot, ids[:-1])
    assert torch.allclose(ours.lm_head(hidden), hf_logits[:-1], atol=1e-4, rtol=1e-4)
    # the training MTP head on the whole window ...
    mtp = mod.MTPHead(hf.config)
    from safetensors.torch import load_file
    state = {k.removeprefix("mtp."): v.float() for k, v in load_file(str(out / "mtp.safetensors")).items()}
    mtp.load_state_dict(state)
    with torch.no_grad():
        emb = hf.model.embed_tokens(ids[None, 1:])
        T = ids.numel() - 1
        pos = torch.arange(1, T + 1)[None]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        m = mtp(emb, hf_out.last_hidden_state[:, :-1], hf.model.rotary_emb(emb, pos), mask)
        train_logits = hf.lm_head(m)[0]                      # row p-1: position p, predicts x_{p+1}
    # ... equals Bole's drafter: prompt x_0..x_10 observed, root x_11 drafted at position 11
    from bole.speculative.tree_growth import NodeTable
    drafter = MTPDrafter(ours, 1, 64, 8)
    drafter.observe_prompt(slot, ids[:-1], hidden)
    step = drafter.step_fn(torch.tensor([slot], dtype=torch.int32), torch.tensor([11]), topk=4)
    tokens, probs = step(0, torch.tensor([[0]]), NodeTable.empty(ids[-1:], 5))
    want = torch.topk(torch.softmax(train_logits[-1], -1), 4)
    assert torch.equal(tokens[0, 0], want.indices)
    assert torch.allclose(probs[0, 0], want.values, atol=1e-4, rtol=1e-4)


def test_eval_script_runs_every_mode_and_checks_greedy_equality(trained, capsys):
    ev = load_script("train/eval_bundled.py")
    _, out = trained
    assert ev.main(["--model", str(out), "--snippets", "3", "--snippet-len", "24", "--humaneval", "2",
                    "--max-tokens", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "heldout_stdlib" in report
    for name, r in report.items():
        assert r["tree"]["equal_to_ar"] and r["chain"]["equal_to_ar"]
        # the statistics account for every token: the first of each prompt comes from the
        # prefill, the rest from rounds; ar emits exactly one per round
        assert r["ar"]["mean_accepted_tokens"] == 1.0
        for mode in ("tree", "chain", "ar"):
            m = r[mode]
            assert m["tokens"] == r["ar"]["tokens"]
            assert m["mean_accepted_tokens"] * m["rounds"] == pytest.approx(m["tokens"] - r["prompts"])
