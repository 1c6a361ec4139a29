"""What a round (or a prefill) tells the host: one ``RoundReport`` per call, named field by field.

It travels as ONE int32 array ``[rows, ...]`` (a single device-to-host read per round):
``encode`` lays it out inside the jit and ``RoundReport.decode`` is the only reader, so
the layout is written down here and nowhere else: the emitted tokens (``width`` of them:
1 for AR, else the block), produced, stopped, then with a trace the drafter's top-k per
draft position and for DDTree the tree's tokens and parents (-1 where unused).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class RoundTrace:
    """One row's trace of a round: the drafter's top-k [block - 1, k] and,
    for DDTree, the tree's valid nodes (tokens, parents), root first."""

    draft_topk: np.ndarray
    tree: tuple[np.ndarray, np.ndarray] | None


@dataclasses.dataclass(frozen=True)
class RoundReport:
    """A decoded report, one entry per row: ``tokens`` [rows, width],
    ``produced`` [rows] (how many of them count), ``stopped`` [rows] (the
    row's request hit a stop token), ``trace`` (with a trace, one per row)."""

    tokens: np.ndarray
    produced: np.ndarray
    stopped: np.ndarray
    trace: list[RoundTrace] | None = None

    def emitted(self, row: int) -> list[int]:
        """The tokens row ``row`` produced this round."""
        return [int(t) for t in self.tokens[row, : self.produced[row]]]

    @staticmethod
    def encode(
        tokens: jax.Array,
        produced: jax.Array,
        stopped: jax.Array,
        draft_topk: jax.Array | None = None,
        tree: tuple[jax.Array, jax.Array] | None = None,
    ) -> jax.Array:
        """The report as one int32 array (inside the jit): tokens [B, width],
        produced [B], stopped [B], and with a trace the draft top-k [B,
        block - 1, k] and the tree's (tokens, parents) [B, nodes] each."""
        traced = [] if draft_topk is None else [draft_topk, *(tree or ())]
        flat = [x.reshape(x.shape[0], -1).astype(jnp.int32) for x in traced]
        columns = [
            tokens.astype(jnp.int32),
            produced[:, None].astype(jnp.int32),
            stopped[:, None].astype(jnp.int32),
        ]
        return jnp.concatenate([*columns, *flat], axis=1)

    @classmethod
    def decode(cls, report: jax.Array | np.ndarray, width: int, trace: int = 0) -> RoundReport:
        """The report ``encode`` made for rounds of ``width``
        tokens (and a top-``trace`` trace): waits for it."""
        report = np.asarray(report)
        tokens = report[:, :width]
        produced = report[:, width]
        stopped = report[:, width + 1].astype(bool)
        if not trace:
            return cls(tokens, produced, stopped)
        drafted = (width - 1) * trace
        rest = report[:, width + 2 :]
        topk = rest[:, :drafted].reshape(-1, width - 1, trace)
        traces = [
            RoundTrace(topk[i], _valid_tree(rest[i, drafted:])) for i in range(report.shape[0])
        ]
        return cls(tokens, produced, stopped, traces)


def _valid_tree(columns: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """A DDTree row's (tokens, parents) of its valid
    nodes; None for DFlash, whose trace has no tree."""
    if columns.size == 0:
        return None
    tokens, parents = np.split(columns, 2)
    valid = tokens >= 0
    return tokens[valid], parents[valid]
