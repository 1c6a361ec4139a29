"""The host side of a paged cache: which pages of the pool each row holds, and which hold a
prefix that later requests may reuse.

A pool of ``pool_pages`` pages is split into ``devices`` equal shares (one share when the cache
is not striped); the first page of each share is that share's null page, which no request holds:
a row's table names it where the row holds no page, so a write there lands nowhere that is read.
A row's page j comes from share ``j % devices`` (``jaxdd.cache.stripes`` reads it there). A
request takes the pages its tokens can reach when it is admitted and gives them back when it
ends: admission waits for free pages, not for free rows.

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
from collections.abc import Sequence

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


class PrefixIndex:
    """Full pages of committed tokens, keyed by their page of tokens and their parent: page j
    of a sequence is found only under the pages of its first j pages of tokens."""

    def __init__(self, page: int):
        self.page = page
        # (parent node, a page of tokens) -> (node, page id); node 0 is the empty prefix
        self._nodes: dict[tuple[int, tuple[int, ...]], tuple[int, int]] = {}
        self._keys: dict[int, tuple[int, tuple[int, ...]]] = {}  # page id -> its key
        self._count = 0

    def __contains__(self, page: int) -> bool:
        return page in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def _blocks(self, tokens: Sequence[int], pages: int):
        for j in range(pages):
            yield tuple(tokens[j * self.page : (j + 1) * self.page])

    def match(self, tokens: Sequence[int], pages: int) -> list[int]:
        """The page ids of the longest cached run of ``tokens``'s first ``pages`` pages."""
        node, found = 0, []
        for block in self._blocks(tokens, pages):
            if (node, block) not in self._nodes:
                break
            node, page = self._nodes[node, block]
            found.append(page)
        return found

    def add(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        """Key ``pages`` (page ids) by ``tokens``'s pages of tokens, up to the first that is
        cached already in another page: a cached page's parent is then in every row that holds
        it, so evicting a page no row holds never cuts a prefix a row holds."""
        node = 0
        for block, page in zip(self._blocks(tokens, len(pages)), pages, strict=True):
            key = (node, block)
            if key not in self._nodes:
                self._count += 1
                self._nodes[key] = (self._count, int(page))
                self._keys[int(page)] = key
            elif self._nodes[key][1] != page:
                return
            node = self._nodes[key][0]

    def drop(self, page: int) -> None:
        """Forget ``page`` (the pages keyed after it are older: evicted before it)."""
        del self._nodes[self._keys.pop(page)]

    def clear(self) -> None:
        self._nodes.clear()
        self._keys.clear()


class PageTable:
    """The page tables of ``rows`` rows of ``row_pages`` pages each, over a pool of
    ``pool_pages`` pages (null pages included) split over ``devices``; with ``prefix``, the
    pages of finished prompts and outputs kept for requests that start the same way."""

    def __init__(
        self,
        rows: int,
        row_pages: int,
        pool_pages: int,
        devices: int = 1,
        page: int = PAGE_TOKENS,
        prefix: bool = False,
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
        self._refs = np.zeros((pool_pages,), np.int32)  # rows holding each page
        # each share's cached pages no row holds, the least recently used first
        self._cached = [collections.OrderedDict() for _ in range(devices)]
        self.prefix = PrefixIndex(page) if prefix else None

    @property
    def usable(self) -> int:
        """Pages a request can hold: the pool less its null pages."""
        return self.pool_pages - self.devices

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

    def _needs(self, pages: int) -> list[int]:
        """Pages of each share that a row of ``pages`` pages takes."""
        return [len(range(d, pages, self.devices)) for d in range(self.devices)]

    def hits(self, prompt: Sequence[int] | None) -> list[int]:
        """The cached pages a request with ``prompt`` starts with (None: it uses none); never its
        last token's page, which its prefill must compute."""
        if self.prefix is None or prompt is None:
            return []
        return self.prefix.match(prompt, (len(prompt) - 1) // self.page)

    def admissible(
        self,
        reaches: list[int],
        release: tuple[int, ...] = (),
        prompts: list[Sequence[int] | None] | None = None,
    ) -> int:
        """How many requests reaching ``reaches`` slots (with ``prompts``, their cache hits
        counted), in order, find their pages once the rows ``release`` hold theirs no more.
        A cached page no row holds costs one page, whether a request reuses it or evicts it
        for a new one, so the count holds whichever pages the takes evict."""
        prompts = prompts or [None] * len(reaches)
        available = [len(f) + len(c) for f, c in zip(self._free, self._cached, strict=True)]
        refs: dict[int, int] = {}
        for row in set(release):
            for page in self.table[row, : self._held.get(row, 0)].tolist():
                refs[page] = refs.get(page, self._refs[page]) - 1
                available[page // self.share] += refs[page] == 0
        for count, (tokens, prompt) in enumerate(zip(reaches, prompts, strict=True)):
            pages = pages_for(tokens, self.page)
            if pages > self.row_pages:
                return count
            hits = self.hits(prompt)
            cost = self._needs(pages)
            for page in hits:
                cost[page // self.share] -= refs.get(page, self._refs[page]) > 0
            if any(c > a for c, a in zip(cost, available, strict=True)):
                return count
            available = [a - c for a, c in zip(available, cost, strict=True)]
            for page in hits:
                refs[page] = refs.get(page, self._refs[page]) + 1
        return len(reaches)

    def fits(self, tokens: int, prompt: Sequence[int] | None = None) -> bool:
        """Whether a request reaching ``tokens`` slots finds its pages free now."""
        return self.admissible([tokens], prompts=[prompt]) == 1

    def take(self, row: int, tokens: int, prompt: Sequence[int] | None = None) -> int:
        """Row ``row`` (holding nothing) takes the pages of its first ``tokens`` slots, those
        its ``prompt`` starts with from the cache: the tokens it found cached."""
        if row in self._held or not self.fits(tokens, prompt):
            raise InputError.at("cache_tokens", f"no {pages_for(tokens, self.page)} free pages")
        hits = self.hits(prompt)
        for j in range(pages_for(tokens, self.page)):
            share = j % self.devices
            if j < len(hits):
                page = hits[j]
                self._cached[share].pop(page, None)
            elif self._free[share]:
                page = self._free[share].pop()
            else:
                page, _ = self._cached[share].popitem(last=False)
                self.prefix.drop(page)
            self.table[row, j] = page
            self._refs[page] += 1
        self._held[row] = pages_for(tokens, self.page)
        return len(hits) * self.page

    def insert(self, row: int, tokens: Sequence[int]) -> None:
        """Cache row ``row``'s full pages of ``tokens``, its committed tokens (both caches hold
        their rows): its prompt once prefilled, or more when it ends."""
        if self.prefix is not None:
            pages = min(len(tokens) // self.page, self._held.get(row, 0))
            self.prefix.add(tokens, self.table[row, :pages].tolist())

    def release(self, row: int) -> None:
        """Row ``row``'s pages free again, or cached (a no-op if it holds none)."""
        pages = self._held.pop(row, 0)
        for j in reversed(range(pages)):  # a prefix's later pages are evicted before it
            page = int(self.table[row, j])
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if self.prefix is not None and page in self.prefix:
                    self._cached[j % self.devices][page] = None
                else:
                    self._free[j % self.devices].append(page)
        self.table[row] = self._nulls

    def clear(self) -> None:
        """Every row's pages free, the cache's too (the pool's contents are gone)."""
        for row in list(self._held):
            self.release(row)
        for share, cached in zip(self._free, self._cached, strict=True):
            share.extend(cached)
            cached.clear()
        if self.prefix is not None:
            self.prefix.clear()
