"""The rows of ONE decode state and the host loop over them: admit requests into
rows, ``dispatch`` rounds, ``collect`` their reports. The server's continuous
batching and ``SpeculativeDecoder.generate_batch`` (the CLI) both run on it, stepped by one
driver (``jaxdd.decoding.driver``): the server admits requests one by one between rounds; a batch
is admitted all at once into a new pool (one prefill for every row) and stepped until every row
is done.

Every shape is fixed when the pool is made (``RowShape``): ``rows`` rows, one page table size for
all (from ``max_len``) over a pool of ``cache_tokens`` in pages (a request takes its prompt's and
a round's when admitted, the next ones a round can write as it grows, up to those its
``max_new_tokens`` reach; it is admitted, and grows, while every request can still end, or waits:
``admissible``, ``jaxdd.cache.pages``), one prefill per prompt bucket up
to ``max_prompt`` (with ``max_logprobs`` > 0, a scoring one too, for requests that ask for their
prompt's logprobs), and two rounds per tier: the sampled round, whose greedy rows still decode
greedily (their distributions are one-hot), and the cheaper greedy round, run while every active row
is greedy (the tokens are the same). A tier is the first 1, 4, 16, ... rows or all of them; a round
runs over the fewest that hold every busy row (requests take the lowest free row), so a lightly
loaded pool pays for the rows it uses. With ``max_logprobs`` = k > 0 every round reports each
emitted token's logprob and top-k (one executable whatever a request asks for); a request gets its
own top ``RowRequest.logprobs``. With the prefix cache, a request whose prompt starts with the
pages of an earlier one's committed tokens holds those pages and prefills only the rest.

A request admitted alone is prefilled on its own (batch 1, at its prompt bucket) and copied into
a free row in the same jitted call, the row index traced and the state donated, so admitting
never compiles. Rows never mix: each row's tokens depend only on its own request and its random
stream only on its own seed and its own round count, so a request decodes to what it gives alone.

Nothing waits on the device between rounds: ``admit`` returns once the prefill is dispatched,
and its first token comes back with the report of the next round dispatched (``collect``
hands both at once), so an admission does not drain rounds dispatched ahead (``dispatch``
twice, then ``collect`` the older one, so the host's bookkeeping overlaps the device's
round). A report is only handed to the requests that held its rows when it was dispatched.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import numpy as np

from jaxdd.cache import RowTable
from jaxdd.cache.pages import PageTable
from jaxdd.decoding.checks import (
    OWN_WORDS,
    PoolOptions,
    Words,
    check_request,
    pool_shape,
)
from jaxdd.decoding.programs import state_programs
from jaxdd.decoding.requests import (
    Decoder,
    RowEntry,
    RowRequest,
    RowShape,
    RowUpdate,
    pad_requests,
)
from jaxdd.decoding.round_set import round_name, round_set
from jaxdd.decoding.row_settings import HostSettings
from jaxdd.decoding.sampling import GREEDY
from jaxdd.decoding.speculation import Chooser, Ticket
from jaxdd.decoding.state import DecodeState, RoundSpec, RowSettings
from jaxdd.decoding.updates import DeviceReport, read_updates
from jaxdd.runtime.buckets import prompt_bucket


class RowPool:
    """``rows`` decode rows of one method: ``admit`` requests into free rows, ``dispatch`` rounds
    and ``collect`` their reports."""

    def __init__(
        self, decoder: Decoder, shape: RowShape, prefix_cache: bool = False, auto: bool = False
    ):
        """A pool of ``shape`` (``checks.pool_shape``) with no state yet: the first ``admit`` makes
        it. With ``prefix_cache``, the pages of ended requests kept for prompts that start with
        their tokens (``jaxdd.cache.pages``); with ``auto``, each round one of a set, chosen
        (``jaxdd.decoding.round_set``)."""
        self.decoder = decoder
        self.shape = shape
        self.programs = state_programs(shape.formats(decoder))
        self.models = decoder.models_for(shape.spec)  # every round of the set reads these
        self.round_set = round_set(decoder, shape.spec, shape.greedy_spec, auto)
        self.chooser = Chooser(self.round_set.names)
        self.paused_rounds = 0  # rounds a row waited for pages, over every row
        self.state: DecodeState | None = None
        self.table: RowTable[RowEntry] = RowTable(shape.rows)  # which request holds each row
        # which pages each row holds, and which the prefix cache keeps
        self.pages = PageTable(shape.rows, shape.paging, prefix_cache)
        self.settings = HostSettings(shape.rows, self.pages)
        # Reports not yet read: the prefills since the last dispatch,
        # and per round dispatched those before it and its own.
        self._prefilled: list[DeviceReport] = []
        self._in_flight: collections.deque[list[DeviceReport]] = collections.deque()

    @classmethod
    def serving(
        cls, decoder: Decoder, *, prefix_cache: bool = False, auto: bool = False, **options
    ) -> RowPool:
        """A server's pool of ``PoolOptions(**options)``, its empty state made now: requests are
        admitted into it one by one, each prefilled alone (a prompt longer than
        ``prefill_chunk`` a chunk per round, the other rows decoding meanwhile)."""
        pool = cls(decoder, pool_shape(decoder, PoolOptions(**options)), prefix_cache, auto)
        pool.state = pool._empty_state()
        return pool

    def free_rows(self) -> list[int]:
        return self.table.free()

    def owners(self) -> list[tuple[int, Any]]:
        """(row, owner) of every busy row."""
        return [(row, entry.owner) for row, entry in self.table.items()]

    @property
    def cache_tokens(self) -> int:
        """Tokens the pool of pages holds for requests."""
        return self.pages.paging.tokens

    @property
    def prefix_cache(self) -> bool:
        """Whether ended requests' pages are kept for prompts that start with their tokens."""
        return self.pages.prefix.keeps

    @property
    def cache_usage(self) -> float:
        """The fraction of the pool's pages that requests hold."""
        return self.pages.held / self.pages.usable

    @property
    def busy(self) -> int:
        """Rows held by a request."""
        return len(self.table)

    def check(
        self, request: RowRequest, words: Words = OWN_WORDS, always: tuple[int, ...] = ()
    ) -> RowRequest:
        """``request`` checked for this pool (``checks.check_request``: its stop ids with the
        caller's ``always`` ones, errors in its ``words``). One the pool admits finds its pages
        once enough are free (the pool holds a request of ``max_len``)."""
        return check_request(request, self.shape, self.decoder.config, words, always)

    def admit(self, requests: list[RowRequest], owners: list[Any] | None = None) -> list[int]:
        """Prefill ``requests`` (checked by ``check``; as many as ``admissible`` allows) into free
        rows without waiting for them: their rows. Into a new pool (no state yet) they go
        together, in one prefill at the longest prompt's bucket, the other rows padding, unless a
        prompt is longer than ``prefill_chunk``; else each alone, a prompt longer than that a
        chunk per round. Their first tokens come with the next ``collect``, in updates that name
        their ``owners``."""
        owners = [None] * len(requests) if owners is None else owners
        longest = max(len(request.prompt) for request in requests)
        if self.state is None and longest <= (self.shape.prefill_chunk or self.shape.max_prompt):
            return self._prefill_together(requests, owners)
        if self.state is None:
            self.state = self._empty_state()
        rows = []
        for request, owner in zip(requests, owners, strict=True):
            rows.append(row := self._hold(request, owner))
            entry = self.table.holder(row)
            entry.next = entry.cached_tokens
            self._prefill_next(row, entry)  # before the next takes its pages: it may hit these
        return rows

    def _prefill_next(self, row: int, entry: RowEntry) -> None:
        """Dispatch the next part of ``row``'s prefill: its whole prompt, the rest after its cached
        pages, or the next chunk (each padded to one length: one executable); once the last part
        is dispatched, its report brings the first token."""
        request, start = entry.request, entry.next
        end = len(request.prompt)
        if entry.chunked:
            end = min(end, start + self.shape.prefill_chunk)
        padded = prompt_bucket(self.shape.prefill_chunk if entry.chunked else end - start)
        part = dataclasses.replace(request, prompt=request.prompt[start:end])
        tokens, count, seeds = pad_requests([part], 1, padded)
        one = self.settings.host(slice(row, row + 1))
        mesh = self.decoder.mesh
        spec = self.shape.spec
        args = (spec, self.models, self.state, np.int32(row), tokens, count, one, seeds, mesh)
        last = end == len(request.prompt)
        if start == 0 and last:
            self.state, report = self.programs.prefill_row(*args, request.score_prompt)
        else:
            self.state, report = self.programs.prefill_after(*args, np.int32(start), np.bool_(last))
        entry.next = None if last else end
        if last:
            self.pages.insert(row, request.prompt)  # its rows are in both caches once prefilled
            scored = padded - 1 if request.score_prompt else 0
            holders = [(row, 0, entry)]
            self._prefilled.append(self._prefill_report(report, scored, holders))

    def _prefill_report(self, report: jax.Array, scored: int, holders: list) -> DeviceReport:
        """A prefill's report (its first tokens; with ``scored``, the prompt's scores)."""
        top_logprobs = self.shape.spec.top_logprobs
        return DeviceReport(report, 0, top_logprobs, scored, holders, self.shape.spec.width)

    def _prefill_together(self, requests: list[RowRequest], owners: list[Any]) -> list[int]:
        """``admit`` into a new pool: one prefill of every row, making its state."""
        padded = prompt_bucket(max(len(r.prompt) for r in requests))
        tokens, prompt_len, seeds = pad_requests(requests, self.shape.rows, padded)
        # rows 0, 1, ...: the table is empty
        rows = [self._hold(request, owner) for request, owner in zip(requests, owners, strict=True)]
        settings = self.settings.device()  # the prefill and every round read them
        mesh = self.decoder.mesh
        score = any(r.score_prompt for r in requests)
        paging, spec = self.shape.paging, self.shape.spec
        args = (spec, self.models, tokens, prompt_len, settings, seeds, paging, mesh)
        self.state, report = self.programs.prefill_new(*args, score)
        for row, request in zip(rows, requests, strict=True):
            self.pages.insert(row, request.prompt)  # its rows are in both caches once prefilled
        holders = [(row, row, e) for row, e in self.table.items()]
        scored = padded - 1 if score else 0
        self._prefilled.append(self._prefill_report(report, scored, holders))
        return rows

    def _hold(self, request: RowRequest, owner: Any = None) -> int:
        """A free row for ``request`` (its settings reach the device with the next round)."""
        scored = len(request.prompt) if request.score_prompt else 0
        entry = RowEntry(request.max_new_tokens, owner, 0, request.logprobs, scored, request)
        reach, prompt = self.shape.reach(request), self._cacheable(request)
        row = self.table.take(entry)
        # admitted as ``admissible`` decided (or a new pool, sized for its batch): past it, an
        # InvariantError
        entry.cached_tokens = self.pages.take(row, self.shape.start(request), prompt, reach)
        rest = len(request.prompt) - entry.cached_tokens
        entry.chunked = prompt is not None and rest > (self.shape.prefill_chunk or rest)
        self.settings.hold(row, request)
        return row

    def release(self, row: int) -> None:
        """Free a row (a cancelled request): its device row keeps
        running until a new request overwrites it, which costs nothing
        extra (the round's shape is fixed) and touches no other row: its pages are free again
        (the prefix cache keeps those of its committed tokens) and from the next round on it
        reaches none."""
        entry = self.table.holder(row)
        if entry is not None:
            self.pages.insert(row, self._committed(entry))
        self.table.release(row)
        self.pages.release(row)
        self.settings.free(row)

    def _committed(self, entry: RowEntry) -> list[int]:
        """The tokens whose rows both caches hold for certain: the prompt, and what the rounds
        committed (the newest token is in neither) less the last round's, whose context the
        drafter caches only in the next round."""
        prompt = entry.request.prompt
        if entry.next is not None:  # still prefilling: the parts dispatched
            return prompt[: entry.next]
        lag = 0 if self.shape.spec.method == "ar" else self.shape.spec.width
        kept = max(len(prompt), len(prompt) + entry.produced - 1 - lag)
        return (prompt + entry.output)[:kept]

    def _cacheable(self, request: RowRequest) -> list[int] | None:
        """The prompt the prefix cache may serve (and chunks), None for one whose every
        position's logits are asked for (a scoring prefill computes them all at once)."""
        return None if request.score_prompt else request.prompt

    def release_all(self) -> None:
        """Free every row (their requests failed); rounds in flight still finish."""
        self.table.clear()
        self.pages.clear()
        self.settings.free()

    def admissible(self, requests: list[RowRequest], release: tuple[int, ...] = ()) -> int:
        """How many of ``requests`` (checked), in order, find a free row and their pages once
        ``release``'s rows are free: admission waits for pages as for rows."""
        if set(np.flatnonzero(self.settings.paused)) - set(release):
            return 0  # the pages that free up go to the rows that wait first: none waits forever
        busy = {row for row, _ in self.table.items()}
        rows = len(self.free_rows()) + len(set(release) & busy)
        reaches = [self.shape.reach(r) for r in requests[:rows]]
        prompts = [self._cacheable(r) for r in requests[:rows]]
        starts = [self.shape.start(r) for r in requests[:rows]]
        return self.pages.admissible(reaches, release, prompts, starts)

    def reset(self) -> None:
        """Every row free in a fresh state, nothing in flight: after a fault,
        the old state may have been donated to a call that never returned."""
        self.release_all()
        self._prefilled.clear()
        self._in_flight.clear()
        self.state = None  # the old buffers go before the new ones come
        self.state = self._empty_state()

    @property
    def in_flight(self) -> int:
        """Rounds dispatched and not yet collected."""
        return len(self._in_flight)

    def may_finish(self) -> bool:
        """Whether a busy row may reach its length in the next round
        (a round dispatched ahead of it would be wasted work)."""
        width = self.shape.spec.width
        return any(e.produced + width >= e.max_new_tokens for _, e in self.table.items())

    def needs_round(self) -> bool:
        """Whether a busy row wants more than its prefill's first token (else ``collect`` alone
        ends every row: a prompt scored alone, a request for one token)."""
        return any(
            e.next is not None or e.max_new_tokens > max(e.produced, 1)
            for _, e in self.table.items()
        )

    def dispatch(self) -> None:
        """Start one round for every row without waiting for it: the greedy
        round while every active row is greedy, else the sampled one; before it, the next chunk of
        each row still prefilling."""
        # a prefill dispatched before the round adds to its time
        prefills = bool(self._prefilled) or any(e.next is not None for _, e in self.table.items())
        sampled, tier = self._before_round()
        ticket = dataclasses.replace(self.chooser.choose(tier), timed=not prefills)
        self._run_round(self.round_set.spec(ticket.name, sampled), tier, ticket)

    def _before_round(self) -> tuple[bool, int]:
        """The next chunk of each row still prefilling dispatched and the rows grown: whether the
        round must be the sampled one, and its tier."""
        for row, entry in self.table.items():
            if entry.next is not None:
                self._prefill_next(row, entry)
        self._grow()
        sampled = self.settings.sampled([row for row, _ in self.table.items()])
        return sampled, next(t for t in self.shape.tiers if t > self.table.highest())

    def _grow(self) -> None:
        """Each decoding row takes the pages this round can write (past its length once the rounds
        in flight it runs in are in), oldest first, or waits this round if taking them could leave
        some row unable to end (``PageTable.grow``): it runs paused, its state untouched."""
        ran = collections.Counter(  # rounds in flight each request runs in (not paused)
            id(entry) for reports in self._in_flight for _, _, entry in reports[-1].holders
        )
        length = lambda e: len(e.request.prompt) + max(e.produced - 1, 0)  # committed, known
        ahead = lambda e: ran[id(e)] * self.shape.spec.width + self.shape.round_tokens
        wants = {row: length(e) + ahead(e) for row, e in self.table.items() if e.next is None}
        paused, held = np.zeros_like(self.settings.paused), self.pages.held
        paused[self.pages.grow(wants)] = True
        if self.pages.held != held:
            self.settings.changed()  # the new tables reach the device with this round
        self.settings.pause(paused)
        self.paused_rounds += int(paused.sum())

    def _run_round(self, spec: RoundSpec, tier: int, ticket: Ticket | None = None) -> None:
        settings = self.settings.device()
        if tier == self.shape.rows:
            self.state, report = self.programs.decode_round(spec, self.models, self.state, settings)
        else:
            self.state, report = self.programs.front_round(
                spec, self.models, self.state, settings, tier
            )
        trace = spec.trace if spec.method != "ar" else 0
        running = [(row, e) for row, e in self.table.items() if not self.settings.paused[row]]
        holders = [(row, row, e) for row, e in running if e.next is None]
        proposed = 0 if spec.method == "ar" else spec.budget or spec.block - 1
        own = DeviceReport(
            report, trace, spec.top_logprobs, 0, holders, spec.width, ticket, proposed
        )
        self._in_flight.append([*self._prefilled, own])
        self._prefilled = []

    def collect(self) -> dict[int, RowUpdate]:
        """The oldest dispatched round's new tokens (after the first token of each
        row prefilled before it), or with no round dispatched the prefills', for each
        row still held by the request it ran for; finished rows leave the pool."""
        if self._in_flight:
            reports = self._in_flight.popleft()
        else:
            reports = self._prefilled
            self._prefilled = []
        updates, ended = read_updates(reports, self.table.holder, self.chooser.collected)
        for row in ended:
            self.release(row)
        return updates

    def discard(self) -> None:
        """Wait for the rounds still in flight and drop their
        reports (every row is done: they changed nothing)."""
        jax.block_until_ready([[r.report for r in reports] for reports in self._in_flight])
        self._in_flight.clear()

    def step(self) -> dict[int, RowUpdate]:
        """One round for every row, waited for (with nothing else in flight)."""
        self.dispatch()
        return self.collect()

    def reserve(self) -> RowSettings:
        """Every row's prefill dispatched whole and the pages its request can reach taken, and
        the settings on the device saying so: for a caller that runs rounds on ``state`` itself
        (``jaxdd.testing.rounds.BatchRound``), with no host between them to grow the rows."""
        for row, entry in self.table.items():
            while entry.next is not None:
                self._prefill_next(row, entry)
        self.pages.grow({row: self.shape.reach(e.request) for row, e in self.table.items()})
        self.settings.changed()
        return self.settings.device()

    def time_rounds(self) -> None:
        """Run each round of the set at each tier over a short request, timed for the chooser
        (the first run of each compiles it), before any request is admitted."""
        if self.state is None:
            self.state = self._empty_state()
        length = min(self.shape.spec.width + 1, self.shape.max_len - 1)
        [row] = self.admit([RowRequest([1], length, [], GREEDY)])
        for spec in self.round_set.specs():
            for tier in self.shape.tiers:
                with self.chooser.timing(round_name(spec), tier):
                    self._run_round(spec, tier)
                    self.collect()
        self.release(row)

    def _empty_state(self) -> DecodeState:
        """Every row done until a request is inserted (``RowShape.state_maker``)."""
        return self.decoder.empty_state(self.shape)

    def warm_up(self) -> None:
        """Compile every executable the pool will run: each prompt bucket's prefill (and with
        logprobs its scoring prefill; with the prefix cache, the prefill after a hit; with chunks,
        a chunk's) and each tier's sampled and greedy rounds (twice each, so a second call finds
        what the first left: shardings and layouts settle after one). The prefix cache starts
        empty after it. Its rounds time the set for the chooser and choose nothing: its counts
        and acceptance estimates start at the first round served."""
        requests = self.shape.warm_up_requests(self.prefix_cache)
        for _ in range(2):
            for request in requests:
                self.admit([request])
                # the first token ends it; a prompt in chunks takes a round each
                for _ in range(len(request.prompt) + 1):
                    if self.busy:
                        sampled, tier = self._before_round()
                        spec = self.shape.spec if sampled else self.shape.greedy_spec
                        self._run_round(spec, tier)
                        self.collect()
            self.time_rounds()
            self.pages.clear()  # each pass prefills whole what it prefilled whole before
