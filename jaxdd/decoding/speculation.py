"""Which compiled round a pool runs next (``--budget auto``): the one that maximises the tokens
its rows are expected to get per second, rows x E[tokens | spec] / t(spec, tier).

t is the round's seconds at the tier (the row count it runs over): first a warm-up profile of
the compiled rounds, then refreshed by each round collected (an EMA of the time from its dispatch,
or the previous round's collection if later, to its own collection: the device's time for it while
rounds are dispatched ahead). E is each spec's tokens per row per round (accepted drafts + 1), an
EMA of what its rounds gave; plain decoding's is 1 exactly. Rows are the same for every spec at a
dispatch, so the choice is E / t at the tier. The chooser keeps its spec until another's rate
beats it by ``margin`` (no flapping on noise), runs a spec with no estimate yet at once, and
re-probes a spec not run for ``probe_every`` rounds (once, the choice unchanged), so estimates
that change with the traffic stay fresh. Pure Python: the clock is given.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

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
        margin: float = 0.1,
        probe_every: int = 64,
    ):
        self.names = names
        self.clock = clock
        self.smoothing = smoothing  # an EMA's weight on the newest sample
        self.margin = margin
        self.probe_every = probe_every
        self.seconds: dict[tuple[str, int], float] = {}  # (name, tier): t
        self.tokens: dict[str, float] = {PLAIN: 1.0} if PLAIN in names else {}  # E
        self.rounds = dict.fromkeys(names, 0)  # rounds dispatched per spec
        self.current = names[0]
        self._dispatched = 0
        self._last_run = dict.fromkeys(names, 0)  # the dispatch count at each spec's last
        self._collected = float("-inf")

    def profile(self, name: str, tier: int, seconds: float) -> None:
        """A warm-up timing of ``name``'s round at ``tier``: its t until rounds refresh it."""
        self.seconds[name, tier] = seconds

    def rate(self, name: str, tier: int) -> float | None:
        """E / t of ``name`` at ``tier`` (None while either is unknown)."""
        seconds, tokens = self.seconds.get((name, tier)), self.tokens.get(name)
        if seconds is None or tokens is None:
            return None
        return tokens / max(seconds, 1e-9)

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
        key = (ticket.name, ticket.tier)
        self.seconds[key] = self._mean(self.seconds.get(key), seconds)
        counted = [n for n in tokens if n > 0]
        if ticket.name != PLAIN and counted:
            per_row = sum(counted) / len(counted)
            self.tokens[ticket.name] = self._mean(self.tokens.get(ticket.name), per_row)

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)
