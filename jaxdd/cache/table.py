"""The host side of the cache: which request holds which row. A request takes the lowest free
row when it is admitted (so a round over the first rows holds every busy one) and gives it back
when it ends."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from jaxdd.errors import InvariantError

Holder = TypeVar("Holder")


class RowTable(Generic[Holder]):
    """Which of ``rows`` rows each request holds."""

    def __init__(self, rows: int):
        self.rows = rows
        self._holders: dict[int, Holder] = {}

    def take(self, holder: Holder) -> int:
        """The lowest free row, now ``holder``'s."""
        row = next((r for r in range(self.rows) if r not in self._holders), None)
        if row is None:
            raise InvariantError("no free row: take one only while free() is not empty")
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
