"""Resumable training: the model's and optimizer's state with the step and the history,
saved every few minutes by orbax (atomic: a run killed mid-write keeps the last whole one),
so a run interrupted anywhere continues from its last save with the same command.

Each step draws its batch from ``step_rng(seed, step)``: a resumed run sees the batches the
uninterrupted run would have seen, with no generator state to store.
"""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
from flax import nnx


def step_rng(seed: int, step: int) -> np.random.Generator:
    """The random stream of one training step."""
    return np.random.default_rng([seed, step])


class TrainingCheckpoints:
    """The last save of a run under ``directory`` (``every_minutes`` apart)."""

    def __init__(self, directory: Path, every_minutes: float = 5.0):
        self.manager = ocp.CheckpointManager(
            Path(directory).absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True),
            item_names=("state", "progress"),
        )
        self.every_seconds = every_minutes * 60
        self.saved_at = time.perf_counter()

    def restore(self, model: nnx.Module, optimizer: nnx.Optimizer) -> tuple[int, dict | None]:
        """(last saved step, its history) with ``model`` and ``optimizer`` updated in place;
        (0, None) when nothing was saved yet."""
        step = self.manager.latest_step()
        if step is None:
            return 0, None
        abstract = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), progress=ocp.args.JsonRestore()
            ),
        )
        nnx.update(model, restored.state["model"])
        nnx.update(optimizer, restored.state["optimizer"])
        return step, restored.progress["history"]

    def maybe_save(
        self, step: int, model: nnx.Module, optimizer: nnx.Optimizer, history: dict, force=False
    ) -> bool:
        """Save when ``every_minutes`` passed since the last save (or ``force``)."""
        if not force and time.perf_counter() - self.saved_at < self.every_seconds:
            return False
        state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                progress=ocp.args.JsonSave({"history": json.loads(json.dumps(history))}),
            ),
        )
        self.manager.wait_until_finished()
        self.saved_at = time.perf_counter()
        return True


def refuse_finished(output: Path) -> None:
    """A finished run's output is never overwritten: a one-line error where ``output`` exists."""
    if output.exists():
        raise FileExistsError(errno.EEXIST, "already exists; choose a new directory", output)


def write_history(path: Path, history: dict) -> None:
    """Write a run's history JSON atomically (a temporary file renamed into place)."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(history, indent=2))
    os.replace(partial, path)
