"""Where `bole generate` reads its prompt: --prompt, --prompt - (stdin), --prompt-file (a
200 KB prompt that no command line could carry); text that is not UTF-8 is a one-line error;
--truncate-prompt says how many tokens it dropped."""

import io
import json
import subprocess
import sys

import pytest

from bole.cli import main

PROMPT = "def add(a, b):\n"
FAST = ["--max-tokens", "4", "--device", "cpu", "--mode", "ar", "--json"]


def run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def assert_clean(rc, err, *needles):
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for n in needles:
        assert n in err, (n, err)


def _stdin(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


def test_a_file_and_stdin_give_what_the_flag_gives(capsys, tmp_path, monkeypatch):
    rc, out, _ = run(capsys, "generate", "--prompt", PROMPT, *FAST)
    want = json.loads(out)["token_ids"]
    assert rc == 0
    file = tmp_path / "prompt.txt"
    file.write_text(PROMPT, encoding="utf-8")
    rc, out, _ = run(capsys, "generate", "--prompt-file", str(file), *FAST)
    assert rc == 0 and json.loads(out)["token_ids"] == want
    _stdin(monkeypatch, PROMPT.encode())
    rc, out, _ = run(capsys, "generate", "--prompt", "-", *FAST)
    assert rc == 0 and json.loads(out)["token_ids"] == want
    _stdin(monkeypatch, PROMPT.encode())
    rc, out, _ = run(capsys, "generate", "--prompt-file", "-", *FAST)
    assert rc == 0 and json.loads(out)["token_ids"] == want


def test_a_200kb_prompt_file_is_truncated_with_a_warning(capsys, tmp_path):
    from tokenizers import Tokenizer

    from bole.assets import BUNDLED_MODEL
    from bole.engine.spec import DEFAULT_TREE
    text = "x = 1\n" * 35000                     # 210 KB: past the kernel's argument limit
    file = tmp_path / "long.txt"
    file.write_text(text)
    rc, out, err = run(capsys, "generate", "--prompt-file", str(file), "--truncate-prompt",
                       *FAST)
    assert rc == 0 and len(json.loads(out)["token_ids"]) == 4
    total = len(Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json")).encode(text).ids)
    room = 4096 - 4 - DEFAULT_TREE[0] - 2       # the context less --max-tokens and a round
    warning = [line for line in err.splitlines() if "warning" in line]
    assert warning == [f"[bole] warning: --truncate-prompt dropped the prompt's first "
                       f"{total - room} of {total} tokens (the context of 4096 leaves {room} "
                       f"with --max-tokens 4)"]


@pytest.mark.parametrize("source", ["file", "stdin"])
def test_a_prompt_that_is_not_utf8_is_a_one_line_error(capsys, tmp_path, monkeypatch, source):
    data = b"caf\xe9 au lait"                    # Latin-1
    if source == "file":
        file = tmp_path / "latin1.txt"
        file.write_bytes(data)
        rc, _, err = run(capsys, "generate", "--prompt-file", str(file), *FAST)
        assert_clean(rc, err, str(file), "0xe9", "offset 3")
    else:
        _stdin(monkeypatch, data)
        rc, _, err = run(capsys, "generate", "--prompt", "-", *FAST)
        assert_clean(rc, err, "stdin", "0xe9")


def test_an_argument_that_is_not_utf8_is_a_one_line_error(capsys):
    # Python decodes an undecodable byte of argv to a lone surrogate (surrogateescape)
    rc, _, err = run(capsys, "generate", "--prompt", "x\udcff", *FAST)
    assert_clean(rc, err, "--prompt is not UTF-8", "0xff")
    proc = subprocess.run([sys.executable, "-m", "bole.cli", "generate", "--prompt", b"x\xff",
                           "--device", "cpu"], capture_output=True, timeout=120)
    assert proc.returncode == 2 and b"Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        b"bole generate: --prompt is not UTF-8 text (byte 0xff at character 1); pass the text "
        b"in UTF-8, or --prompt-file with a UTF-8 file"]


def test_a_missing_file_and_two_sources_are_errors(capsys, tmp_path):
    rc, _, err = run(capsys, "generate", "--prompt-file", str(tmp_path / "nope.txt"), *FAST)
    assert_clean(rc, err, "cannot read the prompt", "nope.txt")
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--prompt", "x", "--prompt-file", "y"])
    assert exit_.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_the_demo_reads_its_prompt_the_same_ways(tmp_path, monkeypatch):
    from bole.cli.common import read_prompt
    from bole.cli.parser import build_parser
    file = tmp_path / "prompt.txt"
    file.write_text(PROMPT)
    parser = build_parser()
    assert read_prompt(parser.parse_args(["demo", "--prompt-file", str(file)])) == PROMPT
    _stdin(monkeypatch, PROMPT.encode())
    assert read_prompt(parser.parse_args(["demo", "--prompt", "-"])) == PROMPT
    assert read_prompt(parser.parse_args(["demo"])) is None      # the bundled prompt
