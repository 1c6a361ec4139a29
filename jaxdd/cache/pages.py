"""The host side of a paged cache: which pages of the pool each row holds.

A pool of ``pool_pages`` pages is split into ``devices`` equal shares (one share when the cache
is not striped); the first page of each share is that share's null page, which no request holds:
a row's table names it where the row holds no page, so a write there lands nowhere that is read.
A row's page j comes from share ``j % devices`` (``jaxdd.cache.stripes`` reads it there). A
request takes the pages its tokens can reach when it is admitted and gives them back when it
ends: admission waits for free pages, not for free rows.
"""

from __future__ import annotations

import numpy as np

from jaxdd.errors import InputError

PAGE_TOKENS = 64


def null_table(rows: int, row_pages: int, pool_pages: int, devices: int = 1) -> np.ndarray:
    """[rows, row_pages] int32: every entry the null page of its share."""
    share = pool_pages // devices
    return np.tile((np.arange(row_pages) % devices * share).astype(np.int32), (rows, 1))


def pages_for(tokens: int, page: int = PAGE_TOKENS) -> int:
    """The pages that hold ``tokens`` slots."""
    return -(-tokens // page)


def pool_pages(tokens: int, page: int = PAGE_TOKENS, devices: int = 1) -> int:
    """The pages of a pool that holds ``tokens`` tokens of requests, its null pages included:
    as many on every device."""
    return (-(-pages_for(tokens, page) // devices) + 1) * devices


class PageTable:
    """The page tables of ``rows`` rows of ``row_pages`` pages each, over a pool of
    ``pool_pages`` pages (null pages included) split over ``devices``."""

    def __init__(
        self, rows: int, row_pages: int, pool_pages: int, devices: int = 1, page: int = PAGE_TOKENS
    ):
        if pool_pages % devices or pool_pages < 2 * devices:
            raise InputError.at(
                "cache_tokens",
                f"a pool of {pool_pages} pages cannot give each of {devices} devices a null page "
                "and one more",
            )
        if row_pages % devices:
            raise ValueError(f"row_pages: {row_pages} is not a multiple of {devices} devices")
        self.rows = rows
        self.row_pages = row_pages
        self.pool_pages = pool_pages
        self.devices = devices
        self.page = page
        self.share = pool_pages // devices
        self.table = null_table(rows, row_pages, pool_pages, devices)
        self._nulls = self.table[0].copy()
        # each share's free pages, the lowest on top
        self._free = [
            list(range((d + 1) * self.share - 1, d * self.share, -1)) for d in range(devices)
        ]
        self._held: dict[int, int] = {}  # row -> pages it holds

    @property
    def usable(self) -> int:
        """Pages a request can hold: the pool less its null pages."""
        return self.pool_pages - self.devices

    @property
    def free(self) -> int:
        return sum(map(len, self._free))

    @property
    def held(self) -> int:
        return sum(self._held.values())

    def _needs(self, pages: int) -> list[int]:
        """Pages of each share that a row of ``pages`` pages takes."""
        return [len(range(d, pages, self.devices)) for d in range(self.devices)]

    def admissible(self, reaches: list[int], release: tuple[int, ...] = ()) -> int:
        """How many requests reaching ``reaches`` slots, in order, find their pages free once
        the rows ``release`` hold theirs no more."""
        free = [len(share) for share in self._free]
        for row in set(release):
            free = [f + n for f, n in zip(free, self._needs(self._held.get(row, 0)), strict=True)]
        for count, tokens in enumerate(reaches):
            pages = pages_for(tokens, self.page)
            needs = self._needs(pages)
            if pages > self.row_pages or any(n > f for n, f in zip(needs, free, strict=True)):
                return count
            free = [f - n for f, n in zip(free, needs, strict=True)]
        return len(reaches)

    def fits(self, tokens: int) -> bool:
        """Whether a request reaching ``tokens`` slots finds its pages free now."""
        return self.admissible([tokens]) == 1

    def take(self, row: int, tokens: int) -> None:
        """Row ``row`` (holding nothing) takes the pages of its first ``tokens`` slots."""
        if row in self._held or not self.fits(tokens):
            raise InputError.at("cache_tokens", f"no {pages_for(tokens, self.page)} free pages")
        pages = pages_for(tokens, self.page)
        for j in range(pages):
            self.table[row, j] = self._free[j % self.devices].pop()
        self._held[row] = pages

    def release(self, row: int) -> None:
        """Row ``row``'s pages free again (a no-op if it holds none)."""
        pages = self._held.pop(row, 0)
        for j in reversed(range(pages)):
            self._free[j % self.devices].append(int(self.table[row, j]))
        self.table[row] = self._nulls

    def clear(self) -> None:
        for row in list(self._held):
            self.release(row)
