"""Chat prompts from a checkpoint's folder: ``chat_template.jinja`` first, then
``tokenizer_config.json``'s template (a string, or the one named "default" of a list) with its
BOS and EOS tokens (strings or ``{"content": ...}``), else the plain template; each rendered
text written out by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bole.server.chat import ChatTemplate

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
#: a template that shows every variable the server passes
SHOW = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}{{ eos_token }}")


def _config(folder: Path, **cfg) -> Path:
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def test_no_template_renders_the_plain_one(tmp_path: Path):
    """No template files, or a config without one: each message as a comment, then the
    assistant's turn."""
    want = "# system: Be brief.\n# user: Hi\n# assistant:\n"
    assert ChatTemplate.for_checkpoint(tmp_path).render(MESSAGES) == want
    assert ChatTemplate.for_checkpoint(_config(tmp_path, bos_token="<s>")).render(
        MESSAGES) == want


@pytest.mark.parametrize("bos, eos", [("<s>", "</s>"), ({"content": "<s>"}, {"content": "</s>"})])
def test_the_configs_template_gets_its_special_tokens(tmp_path: Path, bos, eos):
    chat = ChatTemplate.for_checkpoint(_config(tmp_path, chat_template=SHOW, bos_token=bos,
                                               eos_token=eos))
    assert chat.render(MESSAGES) == "<s><system>Be brief.\n<user>Hi\n<assistant></s>"


def test_special_tokens_may_be_missing_or_null(tmp_path: Path):
    chat = ChatTemplate.for_checkpoint(_config(tmp_path, chat_template=SHOW, eos_token=None,
                                               bos_token={"lstrip": False}))
    assert chat.render(MESSAGES) == "<system>Be brief.\n<user>Hi\n<assistant>"


def test_named_templates_take_the_default(tmp_path: Path):
    chat = ChatTemplate.for_checkpoint(_config(tmp_path, chat_template=[
        {"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": SHOW}]))
    assert chat.render(MESSAGES) == "<system>Be brief.\n<user>Hi\n<assistant>"
    plain = ChatTemplate.for_checkpoint(_config(tmp_path, chat_template=[
        {"name": "tool_use", "template": "TOOLS"}]))
    assert plain.render(MESSAGES).startswith("# system: Be brief.\n")


def test_a_jinja_file_comes_before_the_config(tmp_path: Path):
    """``chat_template.jinja`` wins over the config's template, and gets no BOS or EOS."""
    _config(tmp_path, chat_template="CONFIG", bos_token="<s>", eos_token="</s>")
    (tmp_path / "chat_template.jinja").write_text(SHOW)
    assert ChatTemplate.for_checkpoint(tmp_path).render(MESSAGES) == \
        "<system>Be brief.\n<user>Hi\n<assistant>"


def test_blocks_are_trimmed_and_the_sandbox_holds(tmp_path: Path):
    """Block tags leave no newline or indentation behind (trim_blocks, lstrip_blocks, as
    transformers renders); a template cannot reach Python internals."""
    chat = ChatTemplate("{% for m in messages %}\n    {% if m['role'] == 'user' %}\n"
                        "{{ m['content'] }}\n    {% endif %}\n{% endfor %}")
    assert chat.render(MESSAGES) == "Hi\n"
    from jinja2.exceptions import SecurityError
    with pytest.raises(SecurityError):
        ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}").render(MESSAGES)
