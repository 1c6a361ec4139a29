"""Which compiled round a pool runs next (``--budget auto``): the one that maximises the tokens
its rows are expected to get per second, rows x E[tokens | spec] / t(spec, tier).

t is a round's seconds at its tier (the row count it runs over): the round's own cost, first the
fastest of its warm-up timings, plus the cost every round pays at the tier besides it (the host's
bookkeeping and whatever else shares the device), both refreshed by each round collected (its
seconds from its dispatch, or the previous round's collection if later, to its own collection:
the device's time for it while rounds are dispatched ahead). The shared part follows the rounds
quickly (an EMA of weight ``smoothing``, never below 0), the running spec's own cost slowly
(``drift``; a probe's at ``smoothing``), so a spec not run lately is compared at today's
overhead. E is each spec's tokens per row per round
(accepted drafts + 1), an EMA of what its rounds gave; plain decoding's is 1 exactly. Rows are the
same for every spec at a dispatch, so the choice is E / t at the tier. The chooser keeps its spec
until another's rate beats it by ``margin`` (no flapping on noise), runs a spec with no estimate
yet at once, and re-probes a spec not run for ``probe_every`` rounds (once, the choice
unchanged), so estimates that change with the traffic stay fresh. Pure Python: the clock is given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator

PLAIN = "ar"  # plain decoding: one token per row per round, exactly


@dataclasses.dataclass(frozen=True)
class Ticket:
    """A dispatched round: its spec, tier and the clock when it was dispatched."""

    name: str
    tier: int
    at: float


class Chooser:
    """The round to run next among ``names`` (their order breaks ties: the first wins)."""

    def __init__(
        self,
        names: tuple[str, ...],
        clock: Callable[[], float] = time.perf_counter,
        smoothing: float = 0.2,
        drift: float = 0.05,
        margin: float = 0.1,
        probe_every: int = 64,
    ):
        self.names = names
        self.clock = clock
        self.smoothing = smoothing  # the EMAs' weight on the newest sample
        self.drift = drift  # the same for a spec's own cost
        self.margin = margin
        self.probe_every = probe_every
        self.own: dict[tuple[str, int], float] = {}  # (name, tier): the round's own seconds
        self.shared: dict[int, float] = {}  # tier: the seconds every round there adds
        self.tokens: dict[str, float] = {PLAIN: 1.0} if PLAIN in names else {}  # E
        self.rounds = dict.fromkeys(names, 0)  # rounds dispatched per spec
        self.current = names[0]
        self._dispatched = 0
        self._last_run = dict.fromkeys(names, 0)  # the dispatch count at each spec's last
        self._collected = float("-inf")

    @contextlib.contextmanager
    def timing(self, name: str, tier: int) -> Iterator[None]:
        """Time a warm-up run of ``name``'s round at ``tier``: its own cost is the fastest such
        run (noise only ever adds) until rounds refresh it."""
        start = self.clock()
        yield
        seconds = self.clock() - start
        self.own[name, tier] = min(seconds, self.own.get((name, tier), seconds))

    def seconds(self, name: str, tier: int) -> float | None:
        """t of ``name`` at ``tier`` (None while unknown)."""
        own = self.own.get((name, tier))
        return None if own is None else max(own + self.shared.get(tier, 0.0), 1e-9)

    def rate(self, name: str, tier: int) -> float | None:
        """E / t of ``name`` at ``tier`` (None while either is unknown)."""
        seconds, tokens = self.seconds(name, tier), self.tokens.get(name)
        if seconds is None or tokens is None:
            return None
        return tokens / seconds

    def choose(self, tier: int) -> Ticket:
        """The round to dispatch now over ``tier`` rows."""
        self._dispatched += 1
        name = self._pick(tier)
        self.rounds[name] += 1
        self._last_run[name] = self._dispatched
        return Ticket(name, tier, self.clock())

    def _pick(self, tier: int) -> str:
        if len(self.names) == 1:
            return self.current
        unknown = [n for n in self.names if self.rate(n, tier) is None]
        if unknown:
            return unknown[0]
        stale = [n for n in self.names if self._dispatched - self._last_run[n] > self.probe_every]
        if stale:
            return min(stale, key=self._last_run.__getitem__)
        best = max(self.names, key=lambda n: self.rate(n, tier))
        if self.rate(best, tier) > (1 + self.margin) * self.rate(self.current, tier):
            self.current = best
        return self.current

    def collected(self, ticket: Ticket, tokens: list[int]) -> None:
        """``ticket``'s round came back now, giving its rows ``tokens`` each (a row that had
        ended gives none and is not counted)."""
        now = self.clock()
        seconds = now - max(ticket.at, self._collected)
        self._collected = now
        if len(self.names) == 1:
            return
        key, shared = (ticket.name, ticket.tier), self.shared.get(ticket.tier, 0.0)
        if key not in self.own:
            self.own[key] = seconds - shared
        # rounds dispatched ahead can take less than alone: that is their own cost, not negative
        shared = max(shared + self.smoothing * (seconds - self.own[key] - shared), 0.0)
        # a probe's own cost is stale: it takes more of the new sample than the current spec's
        weight = self.drift if ticket.name == self.current else self.smoothing
        self.own[key] += weight * (seconds - shared - self.own[key])
        self.shared[ticket.tier] = shared
        counted = [n for n in tokens if n > 0]
        if ticket.name != PLAIN and counted:
            per_row = sum(counted) / len(counted)
            self.tokens[ticket.name] = self._mean(self.tokens.get(ticket.name), per_row)

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)
