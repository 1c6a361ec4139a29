"""The corpus: the Python standard library's own ``.py``
files, a fixed list with a fixed train/validation split.

Files are listed relative to the stdlib directory, sorted, without tests, ``idlelib``, ``lib2to3``,
``turtledemo``, ``site-packages`` and caches. A file is in validation when the first byte of the
SHA-1 of its relative path is below 13 (~5%), so the split depends on nothing but the file names.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

EXCLUDED_PARTS = {
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "turtledemo",
    "site-packages",
    "__pycache__",
    "ensurepip",
}
VALIDATION_BYTE = 13  # sha1(path)[0] < 13: ~5% of files


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[str]:
    """The corpus: relative paths of the stdlib's ``.py`` files, sorted."""
    root = root or stdlib_root()
    files = (p.relative_to(root) for p in root.rglob("*.py"))
    return sorted(
        str(p) for p in files if not EXCLUDED_PARTS & set(p.parts[:-1]) and "test" not in p.name
    )


def is_validation(relative_path: str) -> bool:
    return hashlib.sha1(relative_path.encode()).digest()[0] < VALIDATION_BYTE


def split(files: list[str]) -> tuple[list[str], list[str]]:
    """(train, validation) file lists."""
    return [f for f in files if not is_validation(f)], [f for f in files if is_validation(f)]


def read_texts(files: list[str], root: Path | None = None) -> Iterator[str]:
    root = root or stdlib_root()
    for name in files:
        yield (root / name).read_text(encoding="utf-8", errors="replace")


def encode_corpus(
    tokenizer, files: list[str], separator: int, root: Path | None = None
) -> np.ndarray:
    """All files' token ids concatenated, each followed by ``separator`` (int32)."""
    ids: list[int] = []
    for text in read_texts(files, root):
        ids.extend(tokenizer.encode(text).ids)
        ids.append(separator)
    return np.asarray(ids, np.int32)


def windows(tokens: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """``batch`` random windows of ``length`` tokens: int32 [batch, length]."""
    starts = rng.integers(0, len(tokens) - length, batch)
    return np.stack([tokens[s : s + length] for s in starts])
