"""`bole generate` end to end on a tiny checkpoint written by transformers, with a tiny tokenizer."""

import json

import pytest

from tests.oracle_imports import block_fast_kernels

block_fast_kernels()  # transformers on its torch paths (tests/oracle_imports.py)

pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from bole.cli import main  # noqa: E402

TEXT = "def add(a, b):\n    return a + b\n\n" * 20 + "for i in range(10):\n    print(i)\n" * 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    path = tmp_path_factory.mktemp("tiny")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                            linear_value_head_dim=16, intermediate_size=48)
    model = Qwen3_5ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    model.save_pretrained(path)
    return path


def run(capsys, *args):
    rc = main(["generate", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_json_output_and_modes_agree(checkpoint, capsys):
    base = ["--model", str(checkpoint), "--prompt", "def add(a, b):\n    return", "--max-tokens", "20",
            "--json", "--device", "cpu"]
    results = {}
    for mode in ("ar", "bole", "tree-serial", "chain"):
        rc, out, _ = run(capsys, *base, "--mode", mode, "--depth", "4", "--topk", "2", "--budget", "8")
        assert rc == 0
        obj = json.loads(out)
        assert set(obj) == {"text", "token_ids", "rounds", "mean_accepted_tokens", "tokens_per_s",
                            "finish_reason", "mode", "drafter", "prefill_s", "decode_s",
                            "elapsed_s"}
        assert obj["mode"] == mode and obj["finish_reason"] in ("length", "stop")
        results[mode] = obj
    assert len({r["text"] for r in results.values()}) == 1          # greedy: identical text
    assert results["ar"]["mean_accepted_tokens"] == 1.0


def test_text_on_stdout_stats_on_stderr(checkpoint, capsys):
    rc, out, err = run(capsys, "--model", str(checkpoint), "--prompt", "for i in", "--max-tokens", "8",
                       "--device", "cpu", "--temperature", "0.7", "--seed", "1")
    assert rc == 0 and "[bole]" in err and "tokens/s" in err and "[bole]" not in out


def test_errors_are_clear(checkpoint, capsys, tmp_path):
    rc, _, err = run(capsys, "--model", str(tmp_path), "--prompt", "x")
    assert rc == 2 and "tokenizer.json" in err
    rc, _, err = run(capsys, "--model", str(checkpoint), "--prompt", "x", "--max-tokens", "0",
                     "--device", "cpu")
    assert rc == 2 and "max-tokens" in err
    rc, _, err = run(capsys, "--model", str(checkpoint), "--prompt", "", "--device", "cpu")
    assert rc == 2 and "prompt" in err
    rc, _, err = run(capsys, "--model", str(checkpoint), "--prompt", "x", "--top-p", "0",
                     "--device", "cpu")
    assert rc == 2 and "top_p" in err


def test_stop_string_cuts_the_text(checkpoint, capsys):
    base = ["--model", str(checkpoint), "--prompt", "for i in", "--max-tokens", "16", "--json",
            "--device", "cpu"]
    _, out, _ = run(capsys, *base)
    full = json.loads(out)["text"]
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop
    rc, out, _ = run(capsys, *base, "--stop", stop)
    obj = json.loads(out)
    assert rc == 0 and obj["text"] == full[: full.find(stop)]
    assert len(obj["token_ids"]) < 16


def test_draft_model_flag(checkpoint, capsys):
    base = ["--model", str(checkpoint), "--prompt", "def add(a, b):", "--max-tokens", "12", "--json",
            "--device", "cpu"]
    _, ar, _ = run(capsys, *base, "--mode", "ar")
    rc, out, _ = run(capsys, *base, "--draft-model", str(checkpoint), "--depth", "3")
    assert rc == 0 and json.loads(out)["text"] == json.loads(ar)["text"]
    assert json.loads(out)["mean_accepted_tokens"] > 1.5           # the target drafts for itself
