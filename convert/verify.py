"""``python -m convert verify DIR``: a jaxdd checkpoint's files against the sizes
and sha256 checksums recorded when it was written (``jaxdd.weights.checksums``)."""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from jaxdd.errors import CheckpointError, checkpoint_directory, read_json
from jaxdd.weights.checkpoint import MARKER, check_files, is_jaxdd_checkpoint, read_meta


def verify_checkpoint(directory: str | Path, progress: bool = True) -> str:
    """A summary line when every file matches, else a
    CheckpointError naming the first file that differs."""
    directory = checkpoint_directory(directory)
    if not is_jaxdd_checkpoint(directory):
        raise CheckpointError(f"{directory}: not a jaxdd checkpoint (no {MARKER})")
    kind = read_json(directory / MARKER).get("kind")
    files = read_meta(directory, kind).get("files") or {}
    total = sum(size for size, _ in files.values())
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="verifying", disable=not progress
    ) as bar:
        check_files(directory, kind, verify=True, progress=bar.update)
    return (
        f"{directory}: {len(files)} files, {total / 1e6:.1f} MB, sizes and sha256 checksums match"
    )
