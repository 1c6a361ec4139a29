"""When a pool of rows (``jaxdd.decoding.rows``) dispatches a round and when it collects one: the
one loop the server's scheduler and ``SpeculativeDecoder.generate_batch`` both run, as
sglang-jax's offline ``Engine`` runs its server's event loop. Each ``step`` dispatches the
next round before it reads the one before (one round ahead, so the host's bookkeeping overlaps
the device's round), as sglang's overlap loop keeps its last batch's result for the next turn.

A round dispatched ahead of a request's last is wasted work once no request can arrive (an
offline batch: every request came at once): then the driver collects first where a busy row may
reach its length, and drops the rounds still in flight once every row is done.
"""

from __future__ import annotations

from typing import Protocol

from jaxdd.decoding.requests import RowUpdate

AHEAD = 2  # rounds in flight before the older is collected


class Pool(Protocol):
    """What the driver needs of a ``RowPool``."""

    @property
    def busy(self) -> int: ...

    @property
    def in_flight(self) -> int: ...

    def needs_round(self) -> bool: ...

    def may_finish(self) -> bool: ...

    def dispatch(self) -> None: ...

    def collect(self) -> dict[int, RowUpdate]: ...

    def discard(self) -> None: ...


class Driver:
    """Steps ``pool``: ``arrivals`` says whether requests may still be admitted between steps
    (a server's), else every request is in the pool already (an offline batch)."""

    def __init__(self, pool: Pool, arrivals: bool):
        self.pool = pool
        self.arrivals = arrivals

    @property
    def running(self) -> bool:
        """Whether a row is busy or a round in flight: a ``step`` has work."""
        return bool(self.pool.busy or self.pool.in_flight)

    def first_tokens(self) -> dict[int, RowUpdate]:
        """An offline batch's prefill reports, read before any round (a server's come with its
        next round's)."""
        return {} if self.arrivals else self.pool.collect()

    def step(self) -> dict[int, RowUpdate]:
        """Dispatch a round if a row needs one and it is not wasted work, then collect the oldest
        once ``AHEAD`` are in flight (or none was dispatched): each row's update, by row."""
        pool = self.pool
        ahead = self.arrivals or not pool.in_flight or not pool.may_finish()
        if pool.needs_round() and ahead:
            pool.dispatch()
            if pool.in_flight < AHEAD:
                return {}
        updates = pool.collect()
        if not (self.arrivals or pool.busy) and pool.in_flight:
            pool.discard()  # every row is done for good: the rounds ahead change nothing
        return updates
