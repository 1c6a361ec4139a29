"""jaxdd checkpoints: ``config.json`` (HF fields) + ``jaxdd.json`` (kind, dtype, expert format, groups) + ``state/``.

The parameters are stored as one orbax item per group: each top-level parameter (``embed``, ``lm_head``, ...)
and each layer (``layers.7``). Groups let the converter write a checkpoint a layer at a time and let a restore
fill target shardings a layer at a time, so neither ever holds the whole model on the host.

Writes are atomic: everything goes into a temporary sibling directory that is renamed into place at the end,
so an interrupted save leaves nothing that ``is_jaxdd_checkpoint`` accepts (and a rerun starts afresh).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from jaxdd.config import DrafterConfig, KimiConfig
from jaxdd.drafter import DFlashDrafter, abstract_drafter
from jaxdd.errors import CheckpointError
from jaxdd.quant import ExpertFormat
from jaxdd.target import KimiTarget, abstract_target

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
    """(group name, subtree) of a parameter pure dict: each layer, and each other top-level entry."""
    for key, value in values.items():
        if key == "layers":
            yield from ((f"layers.{i}", layer) for i, layer in value.items())
        else:
            yield key, value


class CheckpointWriter:
    """Writes a checkpoint group by group into a staging directory; ``finish`` renames it into place.

    >>> with CheckpointWriter(path, "target", config_json, dtype="bfloat16") as writer:
    ...     for group, tree in groups:
    ...         writer.write(group, tree)
    ...     writer.finish()

    Leaving the ``with`` block without ``finish`` (an error, an interrupt) removes the staging directory.
    """

    def __init__(
        self, directory: str | Path, kind: Kind, config: dict, dtype: jnp.dtype, experts: ExpertFormat | None = None
    ):
        self.directory = Path(directory).absolute()
        if self.directory.exists():
            raise FileExistsError(f"{self.directory} already exists; choose a new directory")
        self.meta = {"format": FORMAT_VERSION, "kind": kind, "dtype": jnp.dtype(dtype).name, "groups": []}
        if experts is not None:
            self.meta["experts"] = experts.to_json()
        self.config = config
        self.staging: Path | None = None
        self._checkpointer = ocp.StandardCheckpointer()

    def __enter__(self) -> CheckpointWriter:
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        self.staging = Path(tempfile.mkdtemp(prefix=f".{self.directory.name}.", dir=self.directory.parent))
        return self

    def write(self, group: str, tree: Any) -> None:
        """Store one group (a subtree of arrays; numpy or jax) and wait until it is on disk."""
        self._checkpointer.save(self.staging / "state" / group, {"params": tree})
        self._checkpointer.wait_until_finished()
        self.meta["groups"].append(group)

    def finish(self) -> Path:
        (self.staging / "config.json").write_text(json.dumps(self.config, indent=2))
        (self.staging / MARKER).write_text(json.dumps(self.meta, indent=2))  # last: marks the checkpoint complete
        self.staging.rename(self.directory)
        self.staging = None
        return self.directory

    def __exit__(self, *exc) -> None:
        self._checkpointer.close()
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)


def save_target(model: KimiTarget, directory: str | Path) -> Path:
    """Write ``model`` to a new directory (which must not exist yet)."""
    return _save(model, directory, "target", model.config.to_hf(), model.experts)


def save_drafter(model: DFlashDrafter, directory: str | Path, config: dict) -> Path:
    """Write a drafter with its HF config dict (the z-lab ``config.json``, which export writes back)."""
    return _save(model, directory, "drafter", config, None)


def _save(model: nnx.Module, directory, kind: Kind, config: dict, experts: ExpertFormat | None) -> Path:
    with CheckpointWriter(directory, kind, config, model.dtype, experts) as writer:
        for group, tree in groups_of(nnx.to_pure_dict(nnx.state(model))):
            writer.write(group, tree)
        return writer.finish()


def read_meta(directory: str | Path, kind: Kind) -> dict[str, Any]:
    directory = Path(directory).absolute()
    meta = json.loads((directory / MARKER).read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{directory / MARKER}: format {meta.get('format')}, this jaxdd reads {FORMAT_VERSION}")
    if meta.get("kind") != kind:
        raise CheckpointError(f"{directory}: a jaxdd {meta.get('kind')} checkpoint, not a {kind}")
    return meta


def abstract_model(directory: str | Path, kind: Kind) -> tuple[nnx.GraphDef, nnx.State]:
    """The stored model's structure and parameter shapes/dtypes, nothing allocated."""
    directory = Path(directory)
    meta = read_meta(directory, kind)
    dtype = jnp.dtype(meta["dtype"])
    if kind == "target":
        experts = ExpertFormat.from_json(meta.get("experts", {}))
        return abstract_target(KimiConfig.from_json_file(directory / "config.json"), dtype, experts)
    return abstract_drafter(DrafterConfig.from_json_file(directory / "config.json"), dtype)


def restore_groups(directory: str | Path, abstract: dict, shardings: dict | None = None) -> Iterator[tuple[str, Any]]:
    """(group, subtree) restored one group at a time; with ``shardings`` (a tree like ``abstract`` of
    ``jax.sharding.Sharding``), each array lands directly in its sharding, never whole on one host."""
    directory = Path(directory).absolute()
    checkpointer = ocp.StandardCheckpointer()
    try:
        for group in json.loads((directory / MARKER).read_text())["groups"]:
            target = get_path(abstract, group_path(group))
            if shardings is not None:
                target = jax.tree.map(
                    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                    target,
                    get_path(shardings, group_path(group)),
                )
            yield group, checkpointer.restore(directory / "state" / group, {"params": target})["params"]
    finally:
        checkpointer.close()


def load_checkpoint(
    directory: str | Path, kind: Kind, dtype: jnp.dtype | None = None, shardings: dict | None = None
) -> nnx.Module:
    """Restore a target or drafter checkpoint; ``dtype`` casts floating weights (router, quantized experts keep
    theirs); ``shardings`` as in ``restore_groups``."""
    graphdef, abstract = abstract_model(directory, kind)
    values = nnx.to_pure_dict(abstract)
    for group, tree in restore_groups(directory, values, shardings):
        set_path(values, group_path(group), tree)
    nnx.replace_by_pure_dict(abstract, values)
    model = nnx.merge(graphdef, abstract)
    if dtype is None or jnp.dtype(dtype) == jnp.dtype(model.dtype):
        return model
    return cast_model(model, dtype)


def cast_model(model: nnx.Module, dtype: jnp.dtype) -> nnx.Module:
    """A copy of a target or drafter computing in ``dtype``; parameters whose dtype is fixed by design (the fp32
    router, quantized expert pieces) keep it."""
    if isinstance(model, KimiTarget):
        graphdef, abstract = abstract_target(model.config, dtype, model.experts)
    else:
        graphdef, abstract = abstract_drafter(model.config, dtype)
    return nnx.merge(graphdef, jax.tree.map(lambda a, x: x.astype(a.dtype), abstract, nnx.state(model)))


def get_path(tree: dict, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def set_path(tree: dict, path: tuple, value) -> None:
    get_path(tree, path[:-1])[path[-1]] = value
