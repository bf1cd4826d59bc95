"""Tokenizers: byte-level for the embedded default, ``tokenizer.json`` for a checkpoint.

The byte-level one needs no files, so the default model can take and return
text on a fresh machine. A checkpoint brings its own tokenizer.json (read with
the ``tokenizers`` library); without one it takes token ids only.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from ..errors import CheckpointError

BOS, EOS = 256, 257


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    vocab_size = 260
    eos_id = EOS

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([BOS] if bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class FileTokenizer:
    """A Hugging Face ``tokenizer.json``, with the special tokens its template adds."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _HFTokenizer  # imported only when a checkpoint has one

        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as exc:   # tokenizers raises bare Exceptions that name no file
            raise CheckpointError(f"{path}: not a readable tokenizer ({exc})") from None
        # The turn's end as the tokenizer's own config names it (a chat release: <|im_end|>), besides
        # the engine's stop_token_ids.
        self.eos_id = self._config_eos(Path(path).with_name("tokenizer_config.json"))

    def _config_eos(self, file: Path) -> int | None:
        if not file.is_file():
            return None
        try:
            eos = json.loads(file.read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{file}: unreadable ({exc})") from None
        if isinstance(eos, dict):   # an AddedToken written out whole
            eos = eos.get("content")
        return self._tok.token_to_id(eos) if isinstance(eos, str) else None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(model_path: str | Path | None) -> Tokenizer | None:
    """The tokenizer for ``model_path`` (empty: the embedded default), or None if it has none."""
    if not model_path:
        return ByteTokenizer()
    file = Path(model_path) / "tokenizer.json"
    return FileTokenizer(file) if file.is_file() else None
