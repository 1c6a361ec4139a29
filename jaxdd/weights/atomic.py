"""Writing a directory all or nothing: a staging sibling, locked against a second writer, that is
renamed into place when the writing succeeds and removed when it fails; stagings a killed run
left behind are removed by the next run."""

from __future__ import annotations

import contextlib
import fcntl
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from jaxdd.errors import CheckpointError

# held (flock) by the process writing a staging directory; the kernel drops it at any exit
STAGING_LOCK = ".lock"
# a staging directory without a lock file this old was left by a crash
UNLOCKED_STAGING_SECONDS = 60


@contextlib.contextmanager
def atomic_directory(directory: str | Path, needed_bytes: int = 0) -> Iterator[Path]:
    """Yield a staging directory next to ``directory`` that is renamed to it when the
    block succeeds and removed when it fails (an error, an interrupt), so
    ``directory`` is either complete or absent. Staging directories that a killed run
    left behind are removed first; a live one (another process writing ``directory``)
    is refused, and so is a disk with less than ``needed_bytes`` free."""
    directory = Path(directory).absolute()
    if directory.exists():
        raise FileExistsError(f"{directory} already exists; choose a new directory")
    directory.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_staging(directory)
    free = shutil.disk_usage(directory.parent).free
    if needed_bytes > free:
        raise CheckpointError(
            f"{directory}: needs up to {needed_bytes / 1e6:,.1f} MB, {free / 1e6:,.1f} MB "
            f"free on {directory.parent}"
        )
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    lock = (staging / STAGING_LOCK).open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        staging.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary directory
        yield staging
        (staging / STAGING_LOCK).unlink()
        try:
            staging.rename(directory)
        except OSError:
            raise FileExistsError(
                f"{directory} appeared while this run wrote it (another run finished first)"
            ) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        lock.close()


def _remove_abandoned_staging(directory: Path) -> None:
    """Remove the staging directories of ``directory`` whose writer is
    gone (its lock is free); refuse if one is still being written."""
    prefix = f".{directory.name}."
    for staging in directory.parent.glob(f"{prefix}*"):
        # not ours: another output's, e.g. OUT.x
        if not staging.is_dir() or "." in staging.name[len(prefix) :]:
            continue
        lock_file = staging / STAGING_LOCK
        if lock_file.exists():
            with lock_file.open("a") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise FileExistsError(
                        f"{directory} is being written by another run (staging {staging})"
                    ) from None
        elif time.time() - staging.stat().st_mtime < UNLOCKED_STAGING_SECONDS:
            continue  # just created by another run, which is about to lock it
        shutil.rmtree(staging, ignore_errors=True)
