"""Chat prompts: the checkpoint's chat template (tokenizer_config.json), rendered with jinja2 in
a sandbox as transformers does; a plain template of our own for checkpoints without one (the
bundled model was trained on code, not chats)."""

from __future__ import annotations

import json
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment

#: for checkpoints that ship no chat template: each message as a comment block, then the reply
PLAIN_TEMPLATE = ("{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}# assistant:\n{% endif %}")


class ChatTemplate:
    """Renders a list of ``{"role", "content"}`` messages into the prompt text."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _refuse      # what HF templates call on bad input
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token
        self.source = source

    @classmethod
    def for_checkpoint(cls, folder: str | Path) -> "ChatTemplate":
        """The template in ``folder/tokenizer_config.json`` (or ``chat_template.jinja``), else
        :data:`PLAIN_TEMPLATE`."""
        folder = Path(folder)
        jinja = folder / "chat_template.jinja"
        if jinja.is_file():
            return cls(jinja.read_text())
        cfg_file = folder / "tokenizer_config.json"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())
            source = cfg.get("chat_template")
            if isinstance(source, list):                    # named templates: take "default"
                source = next((t["template"] for t in source if t.get("name") == "default"), None)
            if isinstance(source, str):
                def token(x):
                    return x.get("content", "") if isinstance(x, dict) else (x or "")
                return cls(source, token(cfg.get("bos_token")), token(cfg.get("eos_token")))
        return cls(PLAIN_TEMPLATE)

    def render(self, messages: list[dict]) -> str:
        return self.template.render(messages=messages, add_generation_prompt=True,
                                    bos_token=self.bos_token, eos_token=self.eos_token)


def _refuse(message: str):
    """A template's ``raise_exception(message)``: the messages do not fit the template (the
    server answers 400 with ``message``)."""
    raise ValueError(message)
