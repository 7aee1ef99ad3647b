"""Every error a user can cause on the command line: exit code 2, one line naming the problem
and what to do, no traceback, and nothing loaded before the arguments are checked."""

import json

import pytest
import torch

from bole.assets import BUNDLED_MODEL
from bole.cli import main


def run(capsys, *argv):
    rc = main(list(argv))
    return rc, capsys.readouterr().err


@pytest.fixture
def loads(monkeypatch) -> list[str]:
    """What the command loaded: the checkpoint's config, model weights or tokenizer, each
    refused here (a command that loads before it checks its arguments fails)."""
    from bole.cli import generate
    from bole.models.config import HybridConfig
    from bole.models.qwen3_hybrid import HybridModel
    loaded: list[str] = []

    def refuse(what):
        def load(*args, **kwargs):
            loaded.append(what)
            raise RuntimeError(f"{what} loaded before the arguments were checked")
        return load
    monkeypatch.setattr(HybridConfig, "from_pretrained", refuse("config"))
    monkeypatch.setattr(HybridModel, "from_pretrained", refuse("model"))
    monkeypatch.setattr(generate, "load_tokenizer", refuse("tokenizer"))
    return loaded


def assert_clean(rc, err, *needles):
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for n in needles:
        assert n in err, (n, err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda(capsys):
    assert_clean(*run(capsys, "generate", "--prompt", "x", "--device", "cuda"),
                 "--device cuda", "--device cpu")


@pytest.mark.parametrize("cmd", [["generate", "--prompt", "x"], ["bench"], ["serve"]])
def test_unknown_device(capsys, cmd):
    assert_clean(*run(capsys, *cmd, "--device", "tpu"), "tpu", "cpu or cuda")


@pytest.mark.parametrize("cmd", [["generate", "--prompt", "x", "--device", "cpu"],
                                 ["bench", "--device", "cpu"], ["demo"],
                                 ["serve", "--device", "cpu"]])
def test_missing_folder(capsys, cmd):
    assert_clean(*run(capsys, *cmd, "--model", "/nonexistent/model"),
                 "/nonexistent/model", "does not exist")


def test_a_folder_that_is_not_a_checkpoint(capsys, tmp_path):
    rc, err = run(capsys, "generate", "--prompt", "x", "--model", str(tmp_path),
                     "--device", "cpu")
    assert_clean(rc, err, "is not a checkpoint folder", "config.json")


@pytest.mark.parametrize("content", ["", "{not json"])
def test_empty_or_corrupt_tokenizer(capsys, tmp_path, content):
    (tmp_path / "config.json").write_text((BUNDLED_MODEL / "config.json").read_text())
    (tmp_path / "tokenizer.json").write_text(content)
    rc, err = run(capsys, "generate", "--prompt", "x", "--model", str(tmp_path),
                     "--device", "cpu")
    assert_clean(rc, err, "tokenizer.json", "is not a readable tokenizer")


@pytest.mark.parametrize("flag,value,needle", [("--topk", "1000", "topk"), ("--budget", "9999", "budget"),
                                               ("--depth", "0", "depth"),
                                               ("--max-tokens", "0", "--max-tokens"),
                                               ("--temperature", "-1", "temperature"),
                                               ("--budget-eps", "0.5", "budget_eps is the")])
def test_bad_arguments_fail_before_loading(capsys, loads, flag, value, needle):
    rc, err = run(capsys, "generate", "--prompt", "x", flag, value, "--device", "cpu")
    assert loads == []                         # nothing was loaded first
    assert_clean(rc, err, needle)


def test_prompt_past_the_context_is_refused_or_truncated(capsys):
    long = "x = 1\n" * 3000                     # well past the bundled model's 4,096 positions
    rc, err = run(capsys, "generate", "--prompt", long, "--max-tokens", "4", "--device", "cpu")
    assert_clean(rc, err, "context", "--truncate-prompt")
    rc = main(["generate", "--prompt", long, "--max-tokens", "4", "--device", "cpu",
               "--truncate-prompt", "--json", "--mode", "ar"])
    out = capsys.readouterr()
    assert rc == 0 and len(json.loads(out.out)["token_ids"]) == 4
    assert "prefill" in out.err                 # the progress of a long prefill


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 4)" in text and "--out" in text and "relative to where bole runs" in text


def test_an_empty_api_key_is_refused(capsys):
    """`--api-key "$KEY"` with KEY unset would serve with no key and no warning: refused."""
    rc, err = run(capsys, "serve", "--api-key", "", "--device", "cpu")
    assert_clean(rc, err, "--api-key is empty")
