"""jaxdd checkpoints: ``config.json`` (HF fields) +
``jaxdd.json`` (kind, dtype, expert format, groups) + ``state/``.

The parameters are stored as one orbax item per group: each top-level parameter
(``embed``, ``lm_head``, ...) and each layer (``layers.7``). Groups let the
converter write a checkpoint a layer at a time and let a restore fill target
shardings a layer at a time, so neither ever holds the whole model on the host.

Writes are atomic: everything goes into a temporary sibling directory
that is renamed into place at the end, so an interrupted save leaves
nothing that ``is_jaxdd_checkpoint`` accepts (and a rerun starts afresh).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import json
import logging
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxdd.config import DrafterConfig, KimiConfig
from jaxdd.errors import CheckpointError, read_json
from jaxdd.models.drafter import DFlashDrafter, abstract_drafter
from jaxdd.models.quant import ExpertFormat
from jaxdd.models.target import KimiTarget, abstract_target
from jaxdd.weights import checksums
from jaxdd.weights.atomic import atomic_directory

FORMAT_VERSION = 2
MARKER = "jaxdd.json"
Kind = Literal["target", "drafter"]


def is_jaxdd_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / MARKER).is_file()


def group_path(group: str) -> tuple:
    """``"layers.7"`` -> ("layers", 7); ``"embed"`` -> ("embed",)."""
    head, _, index = group.partition(".")
    return (head, int(index)) if index else (head,)


def groups_of(values: dict) -> Iterator[tuple[str, Any]]:
    """(group name, subtree) of a parameter pure dict:
    each layer, and each other top-level entry."""
    for key, value in values.items():
        if key == "layers":
            yield from ((f"layers.{i}", layer) for i, layer in value.items())
        else:
            yield key, value


@dataclasses.dataclass(frozen=True)
class CheckpointHeader:
    """What a checkpoint says of its weights: its kind, its HF config dict, the dtype of its
    arrays and the format of its routed experts (None: as the dtype)."""

    kind: Kind
    config: dict
    dtype: jnp.dtype
    experts: ExpertFormat | None = None


def write_checkpoint(
    directory: str | Path,
    header: CheckpointHeader,
    groups: Iterable[tuple[str, Any]],
    extra_files: Iterable[Path] = (),
    expected_bytes: int = 0,
) -> Path:
    """Write a checkpoint atomically, one group at a time: ``groups`` yields (name, subtree of
    numpy or jax arrays) and may build each group lazily, so only one is ever held.
    ``extra_files`` (e.g. the tokenizer's) are copied in beside the weights. Every file's size
    and sha256 go into the marker (``jaxdd.weights.checksums``), each group hashed as soon as
    it is written (while its files are in the page cache). With ``expected_bytes`` (the arrays'
    size), a destination without that much free space is refused before anything is written; a
    write that fails (a full or read-only disk) is a CheckpointError, and nothing is kept."""
    meta = {
        "format": FORMAT_VERSION,
        "kind": header.kind,
        "dtype": jnp.dtype(header.dtype).name,
        "groups": [],
        "files": {},
    }
    if header.experts is not None:
        meta["experts"] = header.experts.to_json()
    extra_files = list(extra_files)
    needed = expected_bytes + sum(f.stat().st_size for f in extra_files) if expected_bytes else 0
    try:
        with (
            atomic_directory(directory, needed) as staging,
            ocp.StandardCheckpointer() as checkpointer,
            _orbax_errors_raised_not_logged(),
            _interrupt_between_groups() as check_interrupt,
        ):
            for group, tree in groups:
                checkpointer.save(staging / "state" / group, {"params": tree})
                checkpointer.wait_until_finished()
                meta["groups"].append(group)
                meta["files"] |= checksums.record(staging, [staging / "state" / group])
                check_interrupt()
            (staging / "config.json").write_text(json.dumps(header.config, indent=2))
            for file in extra_files:
                shutil.copyfile(file, staging / file.name)
            written = [staging / "config.json", *(staging / f.name for f in extra_files)]
            meta["files"] |= checksums.record(staging, written)
            # last: marks the checkpoint complete
            (staging / MARKER).write_text(json.dumps(meta, indent=2))
    except (OSError, ValueError) as error:
        reason = _write_failure(error)
        if reason is None:
            raise
        raise CheckpointError(
            f"{Path(directory).absolute()}: cannot write ({reason}); nothing was kept"
        ) from None
    return Path(directory).absolute()


@contextlib.contextmanager
def _interrupt_between_groups() -> Iterator[Callable[[], None]]:
    """Hold a Ctrl-C (SIGINT) until the group being written is complete: orbax writes
    from background threads, and one interrupted mid-save goes on writing into the
    staging directory as it is removed. Yields the check to call between groups (it
    raises the held KeyboardInterrupt); a second Ctrl-C interrupts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None  # signal handlers belong to the main thread
        return
    held = []

    def hold(signum, frame) -> None:
        if held:
            raise KeyboardInterrupt
        held.append(signum)

    def check() -> None:
        if held:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield check
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _orbax_errors_raised_not_logged() -> Iterator[None]:
    """Orbax logs a failed background write with its traceback before ``wait_until_finished`` raises
    it; the raised error is what reaches the user (as one line when it is a failed write)."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        absl.setLevel(level)


def _write_failure(error: Exception) -> str | None:
    """Why a write failed (e.g. "No space left on device"), or None for
    an error that is not a failed write: OSErrors other than an existing
    output, and tensorstore's ValueErrors that carry an OS error code."""
    if isinstance(error, OSError) and not isinstance(error, FileExistsError):
        return error.strerror or str(error)
    failed = (
        re.search(r": ([^:\[]+) \[os_error_code", str(error))
        if isinstance(error, ValueError)
        else None
    )
    return failed.group(1).strip() if failed else None


def save_target(model: KimiTarget, directory: str | Path) -> Path:
    """Write ``model`` to a new directory (which must not exist yet)."""
    groups = groups_of(nnx.to_pure_dict(nnx.state(model)))
    header = CheckpointHeader("target", model.config.to_hf(), model.dtype, model.experts)
    return write_checkpoint(directory, header, groups)


def save_drafter(model: DFlashDrafter, directory: str | Path, config: dict) -> Path:
    """Write a drafter with its HF config dict (the
    z-lab ``config.json``, which export writes back)."""
    groups = groups_of(nnx.to_pure_dict(nnx.state(model)))
    return write_checkpoint(directory, CheckpointHeader("drafter", config, model.dtype), groups)


def read_meta(directory: str | Path, kind: Kind) -> dict[str, Any]:
    directory = Path(directory).absolute()
    meta = read_json(directory / MARKER)
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{directory / MARKER}: format {meta.get('format')}, this jaxdd reads {FORMAT_VERSION}"
        )
    if meta.get("kind") != kind:
        raise CheckpointError(f"{directory}: a jaxdd {meta.get('kind')} checkpoint, not a {kind}")
    return meta


def check_files(
    directory: str | Path,
    kind: Kind,
    verify: bool = False,
    progress: Callable[[int], None] = lambda n: None,
) -> None:
    """Every file the marker records is there with its size, and with
    ``verify`` its sha256 (reads every byte, calling ``progress(bytes)``
    as it goes); a CheckpointError names the first that is not."""
    directory = Path(directory).absolute()
    files = read_meta(directory, kind).get("files")
    if files is None:  # written before jaxdd recorded checksums
        if verify:
            raise CheckpointError(
                f"{directory / MARKER}: records no checksums (written by an older jaxdd); reconvert"
            )
    elif verify:
        checksums.verify(directory, files, progress)
    else:
        checksums.check_sizes(directory, files)


def abstract_model(directory: str | Path, kind: Kind) -> tuple[nnx.GraphDef, nnx.State]:
    """The stored model's structure and parameter shapes/dtypes, nothing allocated."""
    directory = Path(directory)
    meta = read_meta(directory, kind)
    dtype = jnp.dtype(meta["dtype"])
    if kind == "target":
        experts = ExpertFormat.from_json(meta.get("experts", {}))
        return abstract_target(KimiConfig.from_json_file(directory / "config.json"), dtype, experts)
    return abstract_drafter(DrafterConfig.from_json_file(directory / "config.json"), dtype)


def restore_groups(
    directory: str | Path, abstract: dict, shardings: dict | None = None
) -> Iterator[tuple[str, Any]]:
    """(group, subtree) restored one group at a time; with ``shardings`` (a tree
    like ``abstract`` of ``jax.sharding.Sharding``), each array lands directly in
    its sharding, never whole on one host; without, on the default device. Never as
    numpy: orbax restores arrays saved from numpy (as conversion saves them) as
    numpy, and a jitted call copies numpy arguments to the device on every call."""
    directory = Path(directory).absolute()
    checkpointer = ocp.StandardCheckpointer()
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    try:
        for group in read_json(directory / MARKER)["groups"]:
            target = get_path(abstract, group_path(group))
            placement = (
                jax.tree.map(lambda _: default, target)
                if shardings is None
                else get_path(shardings, group_path(group))
            )
            target = jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), target, placement
            )
            tree = _restore_group(checkpointer, directory, group, target)
            bad = first_non_finite(tree)
            if bad is not None:
                where = directory / "state" / group
                raise CheckpointError(f"{where}: tensor {group}.{bad} holds NaN or infinite values")
            yield group, tree
    finally:
        checkpointer.close()


def first_non_finite(tree: Any) -> str | None:
    """The path of the first floating array in ``tree`` holding a NaN
    or an infinity, or None: checked where the arrays are, one
    compiled reduction per group layout (the layers share theirs)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    named = [
        (".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path), x)
        for path, x in leaves
    ]
    floating = [(name, x) for name, x in named if jnp.issubdtype(x.dtype, jnp.inexact)]
    if not floating:
        return None
    flags = _all_finite([x for _, x in floating])
    finite = np.asarray(flags.addressable_data(0))  # replicated: every process holds all of it
    return next((name for (name, _), ok in zip(floating, finite, strict=True) if not ok), None)


@jax.jit
def _all_finite(arrays: list[jax.Array]) -> jax.Array:
    return jnp.stack([jnp.isfinite(x).all() for x in arrays])


ABANDONED_READS_SECONDS = 0.5


def _restore_group(
    checkpointer: ocp.StandardCheckpointer, directory: Path, group: str, target
) -> Any:
    """One group's arrays, or a CheckpointError naming the group when a chunk is damaged
    (tensorstore's ValueError, or orbax's wrapping Exception). After such a failure the group's
    other reads are still in flight: they complete against orbax's event loop, closed by then,
    and print "Event loop is closed" tracebacks, and the abandoned coroutines print errors when
    collected. So the restore runs with stderr held (replayed when it succeeds), and a failure
    waits them out and collects them before raising: the one-line error is all that shows."""
    held = io.StringIO()
    failure = None
    try:
        with contextlib.redirect_stderr(held):
            try:
                return checkpointer.restore(directory / "state" / group, {"params": target})[
                    "params"
                ]
            except Exception as error:
                if not isinstance(error, ValueError) and "error while reading" not in str(error):
                    raise
                # not the error itself: it keeps the coroutines alive
                failure = str(error).splitlines()[0][:200]
            time.sleep(ABANDONED_READS_SECONDS)
            gc.collect()
    finally:
        # restored, or failed for another reason: what was written to stderr is shown
        if failure is None:
            sys.stderr.write(held.getvalue())
    raise CheckpointError(
        f"{directory / 'state' / group}: unreadable ({failure}); python -m convert verify "
        f"{directory} names "
        "the damaged file"
    )


def load_checkpoint(
    directory: str | Path,
    kind: Kind,
    dtype: jnp.dtype | None = None,
    shardings: dict | None = None,
    verify: bool = False,
) -> nnx.Module:
    """Restore a target or drafter checkpoint; ``dtype`` casts floating weights
    (router, quantized experts keep theirs); ``shardings`` as in ``restore_groups``;
    file sizes are checked first, and with ``verify`` their checksums too."""
    check_files(directory, kind, verify)
    graphdef, abstract = abstract_model(directory, kind)
    values = nnx.to_pure_dict(abstract)
    # its checkpointer closed
    with contextlib.closing(restore_groups(directory, values, shardings)) as groups:
        for group, tree in groups:
            set_path(values, group_path(group), tree)
    nnx.replace_by_pure_dict(abstract, values)
    model = nnx.merge(graphdef, abstract)
    if dtype is None or jnp.dtype(dtype) == jnp.dtype(model.dtype):
        return model
    return cast_model(model, dtype)


def cast_model(model: nnx.Module, dtype: jnp.dtype) -> nnx.Module:
    """A copy of a target or drafter computing in ``dtype``; parameters whose dtype is fixed
    by design (the router, as its checkpoint stores it; quantized expert pieces) keep it."""
    if isinstance(model, KimiTarget):
        graphdef, abstract = abstract_target(model.config, dtype, model.experts)
    else:
        graphdef, abstract = abstract_drafter(model.config, dtype)
    return nnx.merge(
        graphdef, jax.tree.map(lambda a, x: x.astype(a.dtype), abstract, nnx.state(model))
    )


def get_path(tree: dict, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def set_path(tree: dict, path: tuple, value) -> None:
    get_path(tree, path[:-1])[path[-1]] = value
