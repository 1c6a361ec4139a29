"""Tokenizers found in a checkpoint directory (``tokenizer.json``, read by the ``tokenizers`` library)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


def load_tokenizer(directory: str | Path) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it ships none (models driven by token ids)."""
    path = Path(directory) / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None
