"""Tokenizers: byte-level for the embedded default, ``tokenizer.json`` for a checkpoint.

The byte-level one needs no files, so the default model can take and return
text on a fresh machine. A checkpoint brings its own tokenizer.json (read with
the ``tokenizers`` library), and its chat template; without one it takes token ids only.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Protocol, Sequence

from ..errors import CheckpointError, InvalidArgument
from .chat import ChatTemplate, load_chat_template, special_tokens

BOS, EOS = 256, 257


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]: ...


class ByteTokenizer:
    vocab_size = 260
    eos_id = EOS
    chat_template = None

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([BOS] if bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        raise InvalidArgument("the embedded default has no chat template: send a prompt or token_ids")


class FileTokenizer:
    """A Hugging Face ``tokenizer.json``, with ``tokenizer_config.json`` beside it when there is
    one: the turn's end (``eos_token``) and the chat template (``runtime.chat``)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _HFTokenizer  # imported only when a checkpoint has one

        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as exc:   # tokenizers raises bare Exceptions that name no file
            raise CheckpointError(f"{path}: not a readable tokenizer ({exc})") from None
        config = _config(Path(path).with_name("tokenizer_config.json"))
        # The turn's end as the tokenizer's own config names it (a chat release: <|im_end|>), besides
        # the engine's stop_token_ids.
        eos = special_tokens(config).get("eos_token")
        self.eos_id = self._tok.token_to_id(eos) if eos is not None else None
        # A template that does not load refuses chats only: prompts and token ids need none.
        self.chat_template: ChatTemplate | None = None
        self._no_template = ("this checkpoint has no chat template (tokenizer_config.json's chat_template, or "
                             "chat_template.jinja): send a prompt or token_ids")
        try:
            self.chat_template = load_chat_template(Path(path).parent, config)
        except CheckpointError as exc:
            self._no_template = f"{exc}: send a prompt or token_ids"

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The ids of ``messages`` rendered with the chat template, up to the assistant's turn. The
        template writes its own special tokens, so the tokenizer adds none (as transformers does)."""
        if self.chat_template is None:
            raise InvalidArgument(self._no_template)
        return self._tok.encode(self.chat_template.render(messages), add_special_tokens=False).ids


def _config(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: unreadable ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{file}: unreadable (not a JSON object)")
    return config


def load_tokenizer(model_path: str | Path | None) -> Tokenizer | None:
    """The tokenizer for ``model_path`` (empty: the embedded default), or None if it has none."""
    if not model_path:
        return ByteTokenizer()
    file = Path(model_path) / "tokenizer.json"
    return FileTokenizer(file) if file.is_file() else None
