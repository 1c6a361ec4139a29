"""The prefix cache's index: which full pages of committed tokens a request may reuse, keyed by
their tokens and every token before them (``jaxdd.cache.pages`` keeps the pages); ``NoPrefix``,
its do-nothing form, when the cache keeps none."""

from __future__ import annotations

from collections.abc import Sequence


class PrefixIndex:
    """Full pages of committed tokens, keyed by their page of tokens and their parent: page j
    of a sequence is found only under the pages of its first j pages of tokens."""

    keeps = True

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


class NoPrefix:
    """The prefix cache when it is off: it finds nothing and keeps nothing."""

    keeps = False

    def __contains__(self, page: int) -> bool:
        return False

    def __len__(self) -> int:
        return 0

    def match(self, tokens: Sequence[int], pages: int) -> list[int]:
        return []

    def add(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        pass

    def drop(self, page: int) -> None:
        pass

    def clear(self) -> None:
        pass
