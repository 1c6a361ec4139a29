"""A tokenizer of one token per byte, for tests of streamed text: ``PerByteFallback``."""

from __future__ import annotations

import codecs

from jaxdd.weights.tokenizer import TextTokenizer


class PerByteFallback(TextTokenizer):
    """A token per byte, decoded as the ``tokenizers`` ByteFallback decoder does: each byte of a
    cut or invalid UTF-8 sequence its own U+FFFD (Python's "replace" gives one per invalid run)."""

    def __init__(self):
        super().__init__({}, {}, None)

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="jaxdd-per-byte")


codecs.register_error(
    "jaxdd-per-byte", lambda error: ("\ufffd" * (error.end - error.start), error.end)
)
