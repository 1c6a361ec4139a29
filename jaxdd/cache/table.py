"""The host side of the cache: how large every row's buffers are, and which request holds
which row. A request takes the lowest free row when it is admitted (so a round over the
first rows holds every busy one) and gives it back when it ends."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from jaxdd.errors import InputError
from jaxdd.runtime.buckets import bucket

CACHE_BUCKETS_PER_OCTAVE = 4
# bucketed lengths past this are multiples of it: a page of the pools
CACHE_ALIGN = 64

Holder = TypeVar("Holder")


def cache_slots(needed: int) -> int:
    """A length bucket for ``needed`` slots, for callers whose requests' lengths vary (a batch
    of the CLI's): up to ``CACHE_ALIGN``, the next power of two; beyond, the next of four sizes
    per octave rounded up to a multiple of ``CACHE_ALIGN``. Requests of lengths in one bucket
    share a table width, hence the round's programs; powers of two throughout would double a
    8257-slot Kimi row to 16384 slots, and attention reads every slot."""
    if needed <= CACHE_ALIGN:
        return bucket(needed)
    return -(-bucket(needed, per_octave=CACHE_BUCKETS_PER_OCTAVE) // CACHE_ALIGN) * CACHE_ALIGN


def row_slots(padded_prompt: int, max_len: int, round_tokens: int, unit: int = 1) -> int:
    """Slots per row for requests of up to ``max_len`` tokens: a padded prompt's rows, or the
    longest request's plus the rows a round writes past its committed tokens before it keeps
    some (``round_tokens``: a draft block, or the tokens a verify writes), in whole ``unit``s
    (a page, on every device of a striped cache): no more, since the kernels' declared reads
    and the reference's gather cover the whole table."""
    return -(-max(padded_prompt, max_len + round_tokens) // unit) * unit


class RowTable(Generic[Holder]):
    """Which of ``rows`` rows each request holds."""

    def __init__(self, rows: int):
        self.rows = rows
        self._holders: dict[int, Holder] = {}

    def take(self, holder: Holder) -> int:
        """The lowest free row, now ``holder``'s."""
        row = next((r for r in range(self.rows) if r not in self._holders), None)
        if row is None:
            raise InputError("no free row: take one only while free() is not empty")
        self._holders[row] = holder
        return row

    def release(self, row: int) -> None:
        """Row ``row`` free again (a no-op if it is)."""
        self._holders.pop(row, None)

    def clear(self) -> None:
        self._holders.clear()

    def holder(self, row: int) -> Holder | None:
        return self._holders.get(row)

    def free(self) -> list[int]:
        return [row for row in range(self.rows) if row not in self._holders]

    def items(self) -> Iterator[tuple[int, Holder]]:
        """(row, holder) of every busy row."""
        return iter(list(self._holders.items()))

    def highest(self) -> int:
        """The highest busy row (0 when none is)."""
        return max(self._holders, default=0)

    def __len__(self) -> int:
        return len(self._holders)

    def __bool__(self) -> bool:
        return bool(self._holders)
