"""jaxdd checkpoints: ``config.json`` (HF fields) + ``jaxdd.json`` (format, dtype) + an orbax ``state/`` tree.

Writes are atomic: everything goes into a temporary sibling directory that is renamed into place at the end,
so an interrupted save leaves nothing that ``is_jaxdd_checkpoint`` accepts.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from jaxdd.config import KimiConfig
from jaxdd.target import KimiTarget, abstract_target

FORMAT_VERSION = 1
MARKER = "jaxdd.json"


def is_jaxdd_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / MARKER).is_file()


def save_target(model: KimiTarget, directory: str | Path) -> Path:
    """Write ``model`` to a new directory (which must not exist yet)."""
    directory = Path(directory).absolute()
    if directory.exists():
        raise FileExistsError(f"{directory} already exists; choose a new directory")
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        (staging / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2))
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(staging / "state", nnx.state(model))
        checkpointer.wait_until_finished()
        meta = {"format": FORMAT_VERSION, "kind": "target", "dtype": jnp.dtype(model.dtype).name}
        (staging / MARKER).write_text(json.dumps(meta))  # written last: marks the checkpoint complete
        staging.rename(directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def load_target_checkpoint(directory: str | Path, dtype: jnp.dtype | None = None) -> KimiTarget:
    """Restore a target saved by ``save_target``; ``dtype`` casts floating weights (router stays fp32)."""
    directory = Path(directory).absolute()
    meta = json.loads((directory / MARKER).read_text())
    if meta.get("format") != FORMAT_VERSION or meta.get("kind") != "target":
        raise ValueError(f"{directory / MARKER}: unsupported checkpoint {meta}")
    config = KimiConfig.from_json_file(directory / "config.json")
    stored = jnp.dtype(meta["dtype"])
    graphdef, abstract = abstract_target(config, stored)
    state = ocp.StandardCheckpointer().restore(directory / "state", abstract)
    model = nnx.merge(graphdef, state)
    if dtype is None or jnp.dtype(dtype) == stored:
        return model
    return cast_target(model, dtype)


def cast_target(model: KimiTarget, dtype: jnp.dtype) -> KimiTarget:
    """A copy of ``model`` computing in ``dtype``; weights that are fp32 by design (the router) stay fp32."""
    graphdef, abstract = abstract_target(model.config, dtype)
    return nnx.merge(graphdef, jax.tree.map(lambda a, x: x.astype(a.dtype), abstract, nnx.state(model)))
