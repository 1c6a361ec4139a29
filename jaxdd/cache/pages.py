"""The host side of a paged cache: which pages of the pool each row holds, and which hold a
prefix that later requests may reuse.

The pool is split into shares, each with a null page (``jaxdd.cache.paging``), which no request
holds: a row's table names it where the row holds no page, so a write there lands nowhere that
is read. A row's page j comes from share ``share_of(j)`` (``jaxdd.cache.stripes`` reads it there).

A request takes pages as it grows, up to a limit (those its prompt and ``max_new_tokens`` can
reach), and gives them back when it ends. Requests together may be promised more pages than the
pool holds, as long as every one of them can still end: a request is admitted, and a row grows,
only if the rows can then all end in some order, each taking the rest of its limit from what is
free once those before it gave theirs back (Dijkstra's banker's algorithm; a page several rows
hold comes back when the last of them ends). A row that may not grow waits a round
(``jaxdd.decoding.rows``): some row can always grow, and no request is admitted while one waits,
so none waits forever. Nothing is preempted: a row's cache never leaves its pages, so its tokens
are those it gives alone.

With a prefix cache, a full page of committed tokens (the target's latent rows and the drafter's
context K/V of the same positions, one page id for both) stays behind when its request ends,
keyed by its tokens and every token before it; a request whose prompt starts with those tokens
holds the same page instead of computing it again. Every usable page is free, cached (no row
holds it: the least recently used goes first when a share runs short) or held by the rows that
count it; a page is only written above its row's committed length, so a shared page never
changes.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxdd.cache.paging import Paging, pages_for, pages_on, share_holding, share_of
from jaxdd.cache.prefix import NoPrefix, PrefixIndex
from jaxdd.errors import InvariantError


@dataclasses.dataclass
class Ledger:
    """What the check that every row can end reads: per row, [rows, shares], its need (its pages to
    come, up to its limit) and the pages it alone holds (given back when it ends); the pages
    several rows hold, ``holders`` [pages, rows], in ``shares`` [pages]: each given back once
    the last of its holders has ended."""

    needs: np.ndarray
    returns: np.ndarray
    holders: np.ndarray
    shares: np.ndarray

    def can_all_end(self, available: np.ndarray) -> bool:
        """Whether the rows can all end in some order from ``available`` [shares] pages: any row
        whose need is available ends first (it only adds to what is available)."""
        if (self.needs.sum(0) <= available).all():
            return True  # in any order
        available, ended = available.copy(), np.zeros(len(self.needs), bool)
        given = np.zeros(len(self.shares), bool)
        while not ended.all():
            ready = ~ended & (self.needs <= available).all(1)
            if not ready.any():
                return False
            ended |= ready
            back = ~given & ~(self.holders & ~ended).any(1)
            available += self.returns[ready].sum(0) + np.bincount(
                self.shares[back], minlength=len(available)
            )
            given |= back
        return True


class PageTable:
    """The page tables of ``rows`` rows, paged as ``paging`` says; with ``prefix``, the pages of
    finished prompts and outputs kept for requests that start the same way."""

    def __init__(self, rows: int, paging: Paging, prefix: bool = False):
        if paging.pool_pages % paging.devices or paging.pool_pages < 2 * paging.devices:
            raise InvariantError(  # checks.pool_shape refuses such a cache_tokens
                f"a pool of {paging.pool_pages} pages cannot give each of {paging.devices} "
                "devices a null page and one more",
            )
        if paging.row_pages % paging.devices:
            raise InvariantError(
                f"row_pages: {paging.row_pages} is not a multiple of {paging.devices} devices"
            )
        self.rows = rows
        self.paging = paging
        self.page = paging.page
        self.devices = paging.devices
        self.share = paging.share
        self.table = paging.null_table(rows)
        self._nulls = self.table[0].copy()
        # each share's free pages (its null page not), the lowest on top
        self._free = [
            list(range(null + self.share - 1, null, -1)) for null in paging.null_pages().tolist()
        ]
        self._held: dict[int, int] = {}  # row -> pages it holds
        self._limit: dict[int, int] = {}  # row -> pages it may grow to
        self._refs = np.zeros((paging.pool_pages,), np.int32)  # rows holding each page
        # each share's cached pages no row holds, the least recently used first
        self._cached = [collections.OrderedDict() for _ in range(self.devices)]
        self.prefix: PrefixIndex | NoPrefix = PrefixIndex(self.page) if prefix else NoPrefix()

    @property
    def usable(self) -> int:
        return self.paging.usable

    @property
    def free(self) -> int:
        return sum(map(len, self._free))

    @property
    def cached(self) -> int:
        """Cached pages no row holds (taken back when a share runs short)."""
        return sum(map(len, self._cached))

    @property
    def held(self) -> int:
        """Pages some row holds (a shared page once)."""
        return int(np.count_nonzero(self._refs))

    def _shares(self, start, end) -> np.ndarray:
        """[..., shares]: how many of a row's pages ``start`` .. ``end`` - 1 (ints, or arrays
        [..., 1]) each share deals."""
        before = lambda n: pages_on(n, np.arange(self.devices), self.devices)
        return before(np.maximum(end, start)) - before(start)

    def _of_shares(self, pages: np.ndarray) -> np.ndarray:
        """[shares]: how many of the page ids ``pages`` each share holds."""
        return np.bincount(share_holding(pages, self.share), minlength=self.devices)

    def _available(self) -> np.ndarray:
        """[shares]: pages a row may take, free or cached (a cached one is evicted)."""
        return np.array([len(f) + len(c) for f, c in zip(self._free, self._cached, strict=True)])

    def _rows(self, skip: tuple[int, ...] = ()) -> list:
        """The rows holding pages, but ``skip``'s, as ``_ledger`` takes them."""
        rows = [row for row in self._held if row not in skip]
        held = np.array([self._held[row] for row in rows], np.int64).reshape(-1, 1)
        limit = np.array([self._limit[row] for row in rows], np.int64).reshape(-1, 1)
        none = np.zeros((self.devices,), np.int64)
        return [
            (self.table[row, : self._held[row]], none, need)
            for row, need in zip(rows, self._shares(held, limit), strict=True)
        ]

    def _ledger(self, rows: list, refs: np.ndarray) -> Ledger:
        """The ``Ledger`` of ``rows`` (each the ids of the pages it holds, the pages it took that
        have no id yet [shares], its need [shares]), ``refs`` counting their holders."""
        count, devices = len(rows), self.devices
        needs = np.array([need for _, _, need in rows], np.int64).reshape(count, devices)
        returns = np.array([new for _, new, _ in rows], np.int64).reshape(count, devices)
        ids = np.concatenate([np.zeros((0,), np.int64), *(ids for ids, _, _ in rows)])
        owner = np.repeat(np.arange(count), [len(ids) for ids, _, _ in rows])
        alone = refs[ids] == 1
        np.add.at(returns, (owner[alone], share_holding(ids[alone], self.share)), 1)
        pages, at = np.unique(ids[~alone], return_inverse=True)
        holders = np.zeros((len(pages), count), bool)
        holders[at, owner[~alone]] = True
        return Ledger(needs, returns, holders, share_holding(pages, self.share))

    def hits(self, prompt: Sequence[int] | None) -> list[int]:
        """The cached pages a request with ``prompt`` starts with (None: it uses none); never its
        last token's page, which its prefill must compute."""
        if prompt is None:
            return []
        return self.prefix.match(prompt, (len(prompt) - 1) // self.page)

    def admissible(
        self,
        reaches: list[int],
        release: tuple[int, ...] = (),
        prompts: list[Sequence[int] | None] | None = None,
        starts: list[int] | None = None,
    ) -> int:
        """How many requests that may reach ``reaches`` slots and take ``starts`` (default: all
        of them) now (with ``prompts``, their cache hits counted), in order, can be admitted
        once the rows ``release`` hold theirs no more: each finds its pages now, and every row
        can still end. A cached page no row holds costs one page, whether a request reuses it or
        evicts it for a new one; a later request shares it only while the takes before could not
        have evicted it (its share's free pages cover them: a page released now counts as cached),
        so the count holds whichever pages the takes evict."""
        prompts = prompts or [None] * len(reaches)
        starts = starts or reaches
        refs, available = self._refs.copy(), self._available()
        free = np.array([len(f) for f in self._free])  # of those, the ones no take evicts for
        for row in set(release):
            ids = self.table[row, : self._held.get(row, 0)]
            refs[ids] -= 1
            available += self._of_shares(ids[refs[ids] == 0])
        rows = self._rows(skip=release)
        for count, (reach, start, prompt) in enumerate(zip(reaches, starts, prompts, strict=True)):
            limit, pages = pages_for(reach, self.page), pages_for(min(start, reach), self.page)
            if limit > self.paging.row_pages:
                return count
            hits = np.asarray(self.hits(prompt)[:pages], np.int64)
            cost = self._shares(0, pages) - self._of_shares(hits[refs[hits] > 0])
            if (cost > available).any():
                return count
            # held from here on: the pages rows hold, and the cached ones no take evicted yet
            sure = hits[(refs[hits] > 0) | (free[share_holding(hits, self.share)] >= 0)]
            cached = self._of_shares(sure[refs[sure] == 0])
            free -= cost - cached  # below 0: the takes evict cached pages of that share
            refs[sure] += 1
            rows = [*rows, (sure, cost - cached, self._shares(pages, limit))]
            available = available - cost
            if not self._ledger(rows, refs).can_all_end(available):
                return count
        return len(reaches)

    def fits(
        self, tokens: int, prompt: Sequence[int] | None = None, limit: int | None = None
    ) -> bool:
        """Whether a request that takes ``tokens`` slots now and may reach ``limit`` (default:
        ``tokens``) is admitted now."""
        return self.admissible([limit or tokens], prompts=[prompt], starts=[tokens]) == 1

    def take(
        self, row: int, tokens: int, prompt: Sequence[int] | None = None, limit: int | None = None
    ) -> int:
        """Row ``row`` (holding nothing) takes the pages of its first ``tokens`` slots, those
        its ``prompt`` starts with from the cache, and may grow to ``limit`` slots (default:
        ``tokens``): the tokens it found cached."""
        if row in self._held or not self.fits(tokens, prompt, limit):  # the caller's bug
            raise InvariantError(
                f"row {row}: held already, or no {pages_for(tokens, self.page)} free pages "
                "(take only what fits() allows)"
            )
        hits = self.hits(prompt)[: pages_for(tokens, self.page)]
        self._held[row] = 0
        self._limit[row] = pages_for(limit or tokens, self.page)
        for page in hits:
            self._cached[share_of(self._held[row], self.devices)].pop(page, None)
            self._hold(row, page)
        self._grow(row, pages_for(tokens, self.page))
        return len(hits) * self.page

    def grow(self, wants: dict[int, int]) -> list[int]:
        """Each row of ``wants`` (row -> slots), in order, holds the pages of its first slots (up
        to its limit) if taking them leaves every row able to end: the rows that may not (they
        hold no more, and wait)."""
        pages_of = lambda row, tokens: min(pages_for(tokens, self.page), self._limit[row])
        growing = {row: pages_of(row, t) for row, t in wants.items()}
        growing = {row: pages for row, pages in growing.items() if pages > self._held[row]}
        if not growing:  # most rounds: no row crosses into a new page
            return []
        rows = list(self._held)
        ledger, available, waiting = self._ledger(self._rows(), self._refs), self._available(), []
        for row, pages in growing.items():
            cost, i = self._shares(self._held[row], pages), rows.index(row)
            ledger.needs[i] -= cost
            ledger.returns[i] += cost
            if (cost <= available).all() and ledger.can_all_end(available - cost):
                available = available - cost
                self._grow(row, pages)
            else:
                ledger.needs[i] += cost
                ledger.returns[i] -= cost
                waiting.append(row)
        return waiting

    def _grow(self, row: int, pages: int) -> None:
        """Row ``row`` takes new pages until it holds ``pages`` (a cached one when its share has
        no free one left: the least recently used)."""
        while self._held[row] < pages:
            share = share_of(self._held[row], self.devices)
            if self._free[share]:
                page = self._free[share].pop()
            else:
                page, _ = self._cached[share].popitem(last=False)
                self.prefix.drop(page)
            self._hold(row, page)

    def _hold(self, row: int, page: int) -> None:
        self.table[row, self._held[row]] = page
        self._refs[page] += 1
        self._held[row] += 1

    def insert(self, row: int, tokens: Sequence[int]) -> None:
        """Cache row ``row``'s full pages of ``tokens``, its committed tokens (both caches hold
        their rows): its prompt once prefilled, or more when it ends."""
        pages = min(len(tokens) // self.page, self._held.get(row, 0))
        self.prefix.add(tokens, self.table[row, :pages].tolist())

    def release(self, row: int) -> None:
        """Row ``row``'s pages free again, or cached (a no-op if it holds none)."""
        pages = self._held.pop(row, 0)
        self._limit.pop(row, None)
        for j in reversed(range(pages)):  # a prefix's later pages are evicted before it
            page = int(self.table[row, j])
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self.prefix:
                    self._cached[share_of(j, self.devices)][page] = None
                else:
                    self._free[share_of(j, self.devices)].append(page)
        self.table[row] = self._nulls

    def clear(self) -> None:
        """Every row's pages free, the cache's too (the pool's contents are gone)."""
        for row in list(self._held):
            self.release(row)
        for share, cached in zip(self._free, self._cached, strict=True):
            share.extend(cached)
            cached.clear()
        self.prefix.clear()
