"""One round of a batch as ``generate_batch`` runs it, on its own, for benchmarks and the tests
that read a round's program: the batch admitted into a pool of rows
(``SpeculativeDecoder.admitted``), every page its requests can reach taken (``RowPool.reserve``),
and the pool's round over every row run on a state the caller gives (a copy of the state after the
prefill to time one round again and again, or the last round's to run on)."""

from __future__ import annotations

import dataclasses

import jax

from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.decoding.rows import RowPool
from jaxdd.decoding.state import DecodeState, RowSettings


@dataclasses.dataclass(frozen=True)
class BatchRound:
    """The round of ``pool`` (its batch admitted and its pages taken) with its rows' ``settings``
    on the device."""

    pool: RowPool
    settings: RowSettings

    @classmethod
    def of(cls, decoder: SpeculativeDecoder, prompts: list[list[int]], **options) -> BatchRound:
        """The round of a batch of ``prompts`` (``generate_batch``'s ``options``), prefilled."""
        pool = decoder.admitted(prompts, **options)
        return cls(pool, pool.reserve())

    @property
    def state(self) -> DecodeState:
        """The state after the prefill (a round donates the state it is given: run it on
        copies, ``copies``, to start from this one again)."""
        return self.pool.state

    def copies(self, count: int) -> list[DecodeState]:
        """``count`` copies of the state after the prefill."""
        return [jax.tree.map(lambda x: x.copy(), self.state) for _ in range(count)]

    def __call__(self, state: DecodeState) -> tuple[DecodeState, jax.Array]:
        """The round over every row from ``state`` (donated): (the new state, its report)."""
        shape = self.pool.shape
        return self.pool.programs.decode_round(shape.spec, self.pool.models, state, self.settings)

    def lower(self) -> jax.stages.Lowered:
        """The round lowered for the state after the prefill: its HLO, compiled or not."""
        shape = self.pool.shape
        round_ = self.pool.programs.decode_round
        return round_.lower(shape.spec, self.pool.models, self.state, self.settings)
