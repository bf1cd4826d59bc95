"""Byte-level tokenizer for the embedded default: token i < 256 is byte i.

Checkpoints with a real tokenizer bring their own; this one needs no files,
so the default model can take and return text on a fresh machine.
"""
from __future__ import annotations

BOS, EOS = 256, 257


class ByteTokenizer:
    vocab_size = 260

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([BOS] if bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
