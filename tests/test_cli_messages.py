"""Messages that say what is wrong: a --max-tokens that leaves no room for any prompt, a
config.json field that is not a number (the file and the field named), --help without empty
defaults, and a demo that describes the tree it runs (the one generate and serve default to)."""

import json
import re
import shutil

import pytest

from bole.assets import BUNDLED_MODEL
from bole.cli import main


def test_max_tokens_past_the_context_names_the_flag_and_the_bound(capsys):
    rc = main(["generate", "--prompt", "x", "--max-tokens", "1000000000", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "--max-tokens 1000000000 leaves no room for a prompt" in err
    assert "--truncate-prompt" not in err and "shorten" not in err


@pytest.mark.parametrize("field,value", [("num_hidden_layers", "four"),
                                         ("hidden_size", None), ("rms_norm_eps", "tiny")])
def test_a_config_field_that_is_not_a_number_is_named_with_its_file(capsys, tmp_path, field,
                                                                     value):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(BUNDLED_MODEL / "tokenizer.json", folder)
    config = json.loads((BUNDLED_MODEL / "config.json").read_text())
    section = config.get("text_config", config)
    section[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    rc = main(["generate", "--model", str(folder), "--prompt", "x", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert f"{folder / 'config.json'}: field {field!r} is {value!r}, not a number" in err


@pytest.mark.parametrize("command", ["demo", "generate", "bench", "serve", "calibrate",
                                     "bench-serve"])
def test_help_shows_each_default_once_and_no_empty_ones(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text and "(default: False)" not in text
    assert re.search(r"\(default: [^()]*\) \(default:", text) is None
    assert "--prompt-file" in text or command not in ("demo", "generate")


def test_the_demo_runs_and_describes_the_default_tree(capsys):
    from bole import generation_demo
    from bole.engine.spec import DEFAULT_TREE
    depth, topk, budget = DEFAULT_TREE
    generation_demo.run(max_tokens=4)
    out = capsys.readouterr().out
    assert f"a depth-{depth}, top-{topk} tree of up to {budget} nodes per round" in out
