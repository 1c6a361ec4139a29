"""File checksums of jaxdd checkpoints: recorded when a checkpoint is written
(``jaxdd.json`` ``files``: relative path -> [bytes, sha256]), sizes checked at every load
(one ``stat`` per file: a deleted group or a truncated file is named before orbax fails on
it), digests checked when asked (``python -m convert verify``, ``--verify-checksums``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jaxdd.errors import CheckpointError

Files = dict[str, list]  # relative path -> [size in bytes, sha256 hex digest]


def digest(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def record(root: Path, paths: list[Path]) -> Files:
    """[size, sha256] of each file in ``paths`` (files, or directories:
    every file under them), keyed by its path relative to ``root``."""
    files = sorted(f for p in paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
    # hashlib drops the GIL: files hash in parallel
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        digests = pool.map(digest, files)
    return {
        str(f.relative_to(root)): [f.stat().st_size, d] for f, d in zip(files, digests, strict=True)
    }


def check_sizes(root: Path, files: Files) -> None:
    """Each recorded file is there with its recorded size,
    or a CheckpointError naming the first that is not."""
    for name, (size, _) in files.items():
        path = root / name
        if not path.is_file():
            raise CheckpointError(
                f"{path}: missing (recorded in {root / 'jaxdd.json'}); the checkpoint is damaged"
            )
        if path.stat().st_size != size:
            raise CheckpointError(
                f"{path}: {path.stat().st_size} bytes, {size} recorded at conversion; the "
                f"checkpoint is damaged"
            )


def verify(root: Path, files: Files, progress: Callable[[int], None] = lambda n: None) -> None:
    """Sizes, then every digest; a CheckpointError names the first file that differs
    (and how many others do). ``progress(bytes)`` is called as each file is checked."""
    check_sizes(root, files)

    def matches(item: tuple[str, list]) -> bool:
        name, (size, expected) = item
        ok = digest(root / name) == expected
        progress(size)
        return ok

    with ThreadPoolExecutor(os.cpu_count()) as pool:
        bad = [
            name for name, ok in zip(files, pool.map(matches, files.items()), strict=True) if not ok
        ]
    if bad:
        others = f" (and {len(bad) - 1} more files)" if len(bad) > 1 else ""
        raise CheckpointError(
            f"{root / bad[0]}: sha256 differs from the one recorded at conversion{others}"
        )
