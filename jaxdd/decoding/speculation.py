"""Which compiled round a pool runs next (``--budget auto``): the one that maximises the tokens
its rows are expected to get per second, rows x E[tokens | spec] / t(spec, tier).

t is a round's seconds at its tier (the row count it runs over), measured from its dispatch, or
the previous round's collection if later, to its own collection (the device's time for it while
rounds are dispatched ahead), rounds behind a prefill left out. It is the spec's base cost times
the tier's load: a busy host slows every round by a factor, so the load cancels out of the
choice and a spec not run lately is compared at today's load. Each spec's first ``samples``
rounds at a tier set its base (their median: one slow round does not; the warm-up's timings ran
on a host still compiling, one round at a time); then the running spec's rounds move the load
quickly (weight ``smoothing``, in logs: one slow round moves it by a root of its slowness) and
its base slowly (``drift``), a probe's its own base at ``smoothing``. E is each spec's tokens
per row per round (accepted drafts + 1), an EMA (weight ``smoothing`` / 2: one row's rounds vary
from 1 to the block) of what its rounds gave; plain decoding's is 1 exactly. Rows are the same
for every spec at a dispatch, so the choice is E / base at the tier. The chooser keeps its spec
until another's rate beats it by ``margin`` (no flapping on noise), runs a spec not yet measured
at the tier at once, and re-probes a spec not run for ``probe_every`` rounds (once, the choice
unchanged), so estimates that change with the traffic stay fresh. Pure Python: the clock is given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Iterator

PLAIN = "ar"  # plain decoding: one token per row per round, exactly


@dataclasses.dataclass(frozen=True)
class Ticket:
    """A dispatched round: its spec, tier, the clock when it was dispatched, and whether its time
    is its own (False: a prefill ran before it)."""

    name: str
    tier: int
    at: float
    timed: bool = True


class Chooser:
    """The round to run next among ``names`` (their order breaks ties: the first wins)."""

    def __init__(
        self,
        names: tuple[str, ...],
        clock: Callable[[], float] = time.perf_counter,
        smoothing: float = 0.2,
        drift: float = 0.05,
        margin: float = 0.05,
        probe_every: int = 64,
        samples: int = 3,
    ):
        self.names = names
        self.clock = clock
        self.smoothing = smoothing  # the EMAs' weight on the newest sample
        self.drift = drift  # the same for the running spec's base
        self.margin = margin
        self.probe_every = probe_every
        self.samples = samples
        self.base: dict[tuple[str, int], float] = {}  # (name, tier): seconds at load 1
        self.load: dict[int, float] = {}  # tier: how much slower than its base a round runs now
        self.timed: dict[tuple[str, int], list[float]] = {}  # its first rounds' seconds at load 1
        self.tokens: dict[str, float] = {PLAIN: 1.0} if PLAIN in names else {}  # E
        self.rounds = dict.fromkeys(names, 0)  # rounds dispatched per spec
        self.current = names[0]
        self._dispatched = 0
        self._last_run = dict.fromkeys(names, 0)  # the dispatch count at each spec's last
        self._tried: dict[tuple[str, int], int] = {}  # rounds dispatched per (name, tier)
        self._collected = float("-inf")

    @contextlib.contextmanager
    def timing(self, name: str, tier: int) -> Iterator[None]:
        """Time a warm-up run of ``name``'s round at ``tier``: its base is the fastest such run
        (noise only ever adds) until its rounds served measure it."""
        start = self.clock()
        yield
        seconds = self.clock() - start
        self.base[name, tier] = min(seconds, self.base.get((name, tier), seconds))

    def seconds(self, name: str, tier: int) -> float | None:
        """t of ``name`` at ``tier`` now (None while unknown)."""
        base = self.base.get((name, tier))
        return None if base is None else base * self.load.get(tier, 1.0)

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
        self._tried[name, tier] = self._tried.get((name, tier), 0) + 1
        return Ticket(name, tier, self.clock())

    def _pick(self, tier: int) -> str:
        if len(self.names) == 1:
            return self.current
        unmeasured = [n for n in self.names if self._tried.get((n, tier), 0) < self.samples]
        unknown = [n for n in self.names if self.rate(n, tier) is None]
        if unmeasured or unknown:
            return (unmeasured or unknown)[0]
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
        if ticket.timed and seconds > 0:
            self._time(ticket.name, ticket.tier, seconds)
        counted = [n for n in tokens if n > 0]
        if ticket.name != PLAIN and counted:
            per_row, old = sum(counted) / len(counted), self.tokens.get(ticket.name)
            weight = self.smoothing / 2
            self.tokens[ticket.name] = per_row if old is None else old + weight * (per_row - old)

    def _time(self, name: str, tier: int, seconds: float) -> None:
        """A round of ``name`` at ``tier`` took ``seconds``: its first rounds set its base, later
        ones split their surprise (in logs) between the tier's load and the base."""
        key, load = (name, tier), self.load.get(tier, 1.0)
        first = self.timed.setdefault(key, [])
        if len(first) < self.samples:
            first.append(seconds / load)
            self.base[key] = statistics.median(first)
            return
        surprise = math.log(seconds / (self.base[key] * load))
        if name == self.current:
            self.load[tier] = load * math.exp(self.smoothing * surprise)
            self.base[key] *= math.exp(self.drift * (1 - self.smoothing) * surprise)
        else:  # a probe: its base is what is stale
            self.base[key] *= math.exp(self.smoothing * surprise)
