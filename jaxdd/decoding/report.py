"""What a round (or a prefill) tells the host: one ``RoundReport`` per call, named field by field.

It travels as ONE int32 array ``[rows, ...]`` (a single device-to-host read per round):
``encode`` lays it out inside the jit and ``RoundReport.decode`` is the only reader, so
the layout is written down here and nowhere else: the emitted tokens (``width`` of them:
1 for AR, else the block), produced, stopped, then with logprobs each emitted token's
log-probability and its position's top-k (ids, log-probabilities), then for a scored prompt
the same for prompt positions 1, 2, ..., then with a trace the drafter's top-k per draft
position and for DDTree the tree's tokens and parents (-1 where unused). Log-probabilities
are float32 bitcast to int32, so the report stays one array.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one token at its position (its distribution before
    temperature and cut-offs) and the ``top`` (id, log-probability) there, best first."""

    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass(frozen=True)
class Logprobs:
    """Log-probabilities for a run of positions per row: ``chosen`` [rows, n], the chosen
    token's, and ``top_ids`` / ``top`` [rows, n, k], the positions' top-k, best first."""

    chosen: np.ndarray
    top_ids: np.ndarray
    top: np.ndarray

    def entries(self, row: int, count: int, k: int) -> list[TokenLogprob]:
        """Row ``row``'s first ``count`` positions, each with its top ``k``."""
        chosen = self.chosen[row, :count].tolist()
        ids = self.top_ids[row, :count, :k].tolist()
        top = self.top[row, :count, :k].tolist()
        return [
            TokenLogprob(c, list(zip(i, t, strict=True)))
            for c, i, t in zip(chosen, ids, top, strict=True)
        ]

    @staticmethod
    def encode(chosen: jax.Array, top_ids: jax.Array, top: jax.Array) -> list[jax.Array]:
        """The columns of ``n`` positions' log-probabilities (inside the jit), as int32."""
        rows = chosen.shape[0]
        as_int = [jax.lax.bitcast_convert_type(x, jnp.int32) for x in (chosen, top)]
        return [as_int[0], top_ids.reshape(rows, -1).astype(jnp.int32), as_int[1].reshape(rows, -1)]

    @classmethod
    def decode(cls, columns: np.ndarray, n: int, k: int) -> Logprobs:
        """``encode``'s columns of ``n`` positions and top-``k``."""
        rows = columns.shape[0]
        chosen = columns[:, :n].view(np.float32)
        top_ids = columns[:, n : n + n * k].reshape(rows, n, k)
        top = columns[:, n + n * k :].view(np.float32).reshape(rows, n, k)
        return cls(chosen, top_ids, top)

    @staticmethod
    def size(n: int, k: int) -> int:
        """Columns of ``n`` positions with a top-``k`` each (0 without logprobs)."""
        return n * (1 + 2 * k) if k else 0


@dataclasses.dataclass(frozen=True)
class RoundTrace:
    """One row's trace of a round: the drafter's top-k [block - 1, k] and,
    for DDTree, the tree's valid nodes (tokens, parents), root first."""

    draft_topk: np.ndarray
    tree: tuple[np.ndarray, np.ndarray] | None


@dataclasses.dataclass(frozen=True)
class RoundReport:
    """A decoded report, one entry per row: ``tokens`` [rows, width], ``produced`` [rows] (how
    many of them count), ``stopped`` [rows] (the row's request hit a stop token), with logprobs
    the emitted tokens' (``logprobs``) and a scored prompt's (``prompt_logprobs``, positions 1,
    2, ...), with a trace one per row (``trace``)."""

    tokens: np.ndarray
    produced: np.ndarray
    stopped: np.ndarray
    trace: list[RoundTrace] | None = None
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None

    def emitted(self, row: int) -> list[int]:
        """The tokens row ``row`` produced this round."""
        return [int(t) for t in self.tokens[row, : self.produced[row]]]

    def scores(
        self, row: int, count: int, k: int | None, prompt: int
    ) -> tuple[list[TokenLogprob] | None, list[TokenLogprob] | None]:
        """Row ``row``'s (logprobs of its first ``count`` tokens, of its prompt's tokens after
        the first if its ``prompt`` > 0 tokens were scored here), each with its top ``k``; None
        for a request that asked for none (``k`` None)."""
        if k is None:
            return None, None
        scores = self.logprobs.entries(row, count, k)
        if self.prompt_logprobs is None or not prompt:
            return scores, None
        return scores, self.prompt_logprobs.entries(row, prompt - 1, k)

    @staticmethod
    def encode(
        tokens: jax.Array,
        produced: jax.Array,
        stopped: jax.Array,
        draft_topk: jax.Array | None = None,
        tree: tuple[jax.Array, jax.Array] | None = None,
        logprobs: tuple[jax.Array, jax.Array, jax.Array] | None = None,
        prompt_logprobs: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    ) -> jax.Array:
        """The report as one int32 array (inside the jit): tokens [B, width], produced [B],
        stopped [B], with logprobs the emitted tokens' and a scored prompt's (``Logprobs.encode``'s
        arrays: chosen [B, n], top ids and top [B, n, k]), and with a trace the draft top-k [B,
        block - 1, k] and the tree's (tokens, parents) [B, nodes] each."""
        traced = [] if draft_topk is None else [draft_topk, *(tree or ())]
        scored = [Logprobs.encode(*x) for x in (logprobs, prompt_logprobs) if x is not None]
        flat = [x.reshape(x.shape[0], -1).astype(jnp.int32) for x in traced]
        columns = [
            tokens.astype(jnp.int32),
            produced[:, None].astype(jnp.int32),
            stopped[:, None].astype(jnp.int32),
        ]
        return jnp.concatenate([*columns, *(c for s in scored for c in s), *flat], axis=1)

    @classmethod
    def decode(
        cls,
        report: jax.Array | np.ndarray,
        width: int,
        trace: int = 0,
        logprobs: int = 0,
        prompt: int = 0,
    ) -> RoundReport:
        """The report ``encode`` made for rounds of ``width`` tokens (with top-``logprobs``
        logprobs, ``prompt`` scored prompt positions, and a top-``trace`` trace): waits for it."""
        report = np.asarray(report)
        tokens = report[:, :width]
        produced = report[:, width]
        stopped = report[:, width + 1].astype(bool)
        rest = report[:, width + 2 :]
        scored = []
        for n in (width, prompt if logprobs else 0):
            size = Logprobs.size(n, logprobs)
            scored.append(Logprobs.decode(rest[:, :size], n, logprobs) if size else None)
            rest = rest[:, size:]
        if not trace:
            return cls(tokens, produced, stopped, None, *scored)
        drafted = (width - 1) * trace
        topk = rest[:, :drafted].reshape(-1, width - 1, trace)
        traces = [
            RoundTrace(topk[i], _valid_tree(rest[i, drafted:])) for i in range(report.shape[0])
        ]
        return cls(tokens, produced, stopped, traces, *scored)


def _valid_tree(columns: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """A DDTree row's (tokens, parents) of its valid
    nodes; None for DFlash, whose trace has no tree."""
    if columns.size == 0:
        return None
    tokens, parents = np.split(columns, 2)
    valid = tokens >= 0
    return tokens[valid], parents[valid]
