"""A checkpoint's chat template: messages (role, content) to the text its model was tuned on.

The template is the Jinja text a release ships in ``tokenizer_config.json`` (``chat_template``,
a string or a list of named templates, of which "default" is taken) or in ``chat_template.jinja``
beside it. It is rendered as transformers renders it, so that the ids a prompt gives here are the
ids it gives there: a sandboxed environment that trims blocks and strips their leading space, the
``loopcontrols`` extension, a ``tojson`` that keeps non-ASCII text as it is, ``raise_exception``
and ``strftime_now``, and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as
variables. A template is code from the checkpoint's author: the sandbox keeps it from reaching
the process, and whatever it raises becomes InvalidArgument with its message.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import CheckpointError, InvalidArgument

TEMPLATE_FILE = "chat_template.jinja"
ROLES_HINT = "system, user, assistant or tool"


class ChatTemplate:
    """``render(messages)``: the prompt text of a conversation, ending where the assistant's
    turn begins (``add_generation_prompt``)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols, _GenerationBlock])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise CheckpointError(f"the chat template does not compile: {exc}") from None
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        checked = [_message(i, m) for i, m in enumerate(messages)]
        if not checked:
            raise InvalidArgument("a chat needs at least one message")
        try:
            return self._template.render(messages=checked, add_generation_prompt=add_generation_prompt, tools=None,
                                         documents=None, **self.special_tokens)
        except jinja2.TemplateError as exc:   # raise_exception's, or the template's own fault
            raise InvalidArgument(f"the chat template refused the messages: {exc}") from None
        except Exception as exc:   # a template is the checkpoint author's code: any fault is its answer
            raise InvalidArgument(f"the chat template failed: {type(exc).__name__}: {exc}") from None


def load_chat_template(folder: str | Path, config: Mapping[str, Any]) -> ChatTemplate | None:
    """The template of the checkpoint in ``folder``, whose ``tokenizer_config.json`` holds
    ``config`` (None when it has none)."""
    file = Path(folder) / TEMPLATE_FILE
    if file.is_file():
        try:
            source = file.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{file}: unreadable ({exc})") from None
    else:
        source = config.get("chat_template")
        if isinstance(source, list):   # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if source is None:
            return None
        if not isinstance(source, str):
            raise CheckpointError(f"{folder}/tokenizer_config.json: chat_template must be a string or a list of "
                                  f"named templates, got {type(source).__name__}")
    return ChatTemplate(source, special_tokens(config))


def special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """``bos_token``, ``eos_token`` and the other ``*_token`` entries of a tokenizer config, as text
    (an added token written out whole gives its content)."""
    found = {}
    for key, value in config.items():
        if isinstance(value, dict):
            value = value.get("content")
        if key.endswith("_token") and isinstance(value, str):
            found[key] = value
    return found


def _message(index: int, message: Mapping[str, str]) -> dict[str, str]:
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        raise InvalidArgument(f"message {index} has no role (one of {ROLES_HINT})")
    if not isinstance(content, str):
        raise InvalidArgument(f"message {index} ({role}) has no text content")
    return {"role": role, "content": content}


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's tokens with it
    for training masks; rendering a prompt, its body is rendered as it is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)
