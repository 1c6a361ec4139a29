"""The one thread that owns the decode state: between rounds it frees the
rows of finished, cancelled and timed-out requests, admits waiting requests
into free rows, then runs a round and hands every request its new tokens.

Requests wait in a bounded queue (``submit`` refuses past ``max_waiting``: the caller
answers 429). Tokens reach a request through its ``deliver`` callback, which must be
thread-safe (the HTTP side wraps an asyncio queue with ``loop.call_soon_threadsafe``).

An exception in a round or an admission fails the requests the pool held (each gets an
error event: a 500) and the pool starts afresh before the next step; only a pool that
cannot is fatal (``failure`` set: /health answers 503). ``drain`` (on shutdown) refuses
new requests and ends what still runs at its deadline with finish reason "abort".

Each step begins with its decisions (rows to free, requests to admit, a reset, or stop),
taken only by the process that leads and shared through ``channel``
(``decisions.Broadcast`` in a job of several processes): every process then carries out the
same decisions, so all make the same device calls in the same order. A follower's scheduler
has no HTTP side and an empty queue; its requests deliver nowhere (process 0 answers them).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
import traceback
from collections.abc import Callable

from jaxdd.decoding.driver import Driver
from jaxdd.decoding.report import TokenLogprob
from jaxdd.decoding.requests import RowRequest, RowUpdate
from jaxdd.decoding.rows import RowPool
from jaxdd.serve.decisions import Broadcast, Decisions, Local
from jaxdd.serve.metrics import Metrics

# seconds the idle loop sleeps between looks at the queue when nothing else wakes it
IDLE_WAIT = 0.05


class QueueFull(Exception):
    """More requests are waiting than the server allows (``--max-waiting``)."""


class NotReady(Exception):
    """The server is still compiling, or its engine failed."""


@dataclasses.dataclass(frozen=True)
class Event:
    """What a request receives: new tokens, and at its end the finish reason ("stop",
    "length", "timeout") or an error message; if it asked, the new tokens' logprobs and
    (with its first tokens) its prompt's."""

    tokens: list[int]
    finish: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclasses.dataclass
class Job:
    """A request on the server's side: what the rows run (checked before it is queued), where
    its tokens go, and its deadlines. The pool holds its row and counts its tokens."""

    request: RowRequest
    deliver: Callable[[Event], None]
    timeout: float | None = None
    arrived: float = dataclasses.field(default_factory=time.monotonic)
    first_token_at: float | None = None
    first_tokens: int = 0  # the tokens delivered with the first (its update holds a round's too)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    _cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Thread-safe: the request's row (or queue place) is freed before the next round."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def expired(self, now: float) -> bool:
        return self.timeout is not None and now - self.arrived > self.timeout


def _nowhere(_: Event) -> None:
    """A follower's requests: process 0 answers them."""


class Scheduler:
    def __init__(
        self,
        pool: RowPool,
        metrics: Metrics,
        max_waiting: int,
        channel: Local | Broadcast | None = None,
    ):
        self.pool = pool
        self.driver = Driver(pool, arrivals=True)
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.channel = channel or Local()
        self._waiting: collections.deque[Job] = collections.deque()
        # rows free after the last admission: requests taking them do not count as waiting
        self._free = pool.shape.rows
        metrics.cache_capacity.set(pool.cache_tokens)
        metrics.count_rounds(pool.chooser)
        self._wake = threading.Condition()
        self._stopping = threading.Event()
        self.ready = threading.Event()
        self.failure: str | None = None  # why the engine stopped, if it did
        self._admitting: list[Job] = []  # decided, not yet in a row
        # a step's fault: the pool is reset at the next step, on every process
        self._fault: str | None = None
        # set on shutdown: admit nothing new, end what runs by then
        self._drain_deadline: float | None = None
        self._thread = threading.Thread(target=self._run, name="jaxdd-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def rows(self) -> int:
        """Requests decoded at once (``--max-batch``)."""
        return self.pool.shape.rows

    @property
    def max_len(self) -> int:
        """Prompt + new tokens, per request."""
        return self.pool.shape.max_len

    @property
    def max_logprobs(self) -> int:
        """Top logprobs a request may ask for per token (``--max-logprobs``; 0: no logprobs)."""
        return self.pool.shape.spec.top_logprobs

    def _running(self) -> list[Job]:
        return [job for _, job in self.pool.owners()]

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        with self._wake:
            self._wake.notify()
        self._thread.join(timeout)

    def join(self) -> None:
        """Wait until the decode thread ends: a follower's,
        once process 0 decided to stop (or it failed)."""
        self._thread.join()

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def drain(self, timeout: float) -> None:
        """Admit no new request; requests already queued or
        running finish, or end ("abort") after ``timeout``."""
        with self._wake:
            self._drain_deadline = time.monotonic() + timeout
            self._wake.notify()

    @property
    def vocab_size(self) -> int:
        return self.pool.decoder.config.vocab_size

    def accepting(self) -> None:
        """Raise ``NotReady`` unless requests are admitted now (compiled, not failed, not
        draining)."""
        if not self.ready.is_set() or self.failure is not None:
            raise NotReady(self.failure or "the server is still compiling")
        if self._drain_deadline is not None:
            raise NotReady("the server is shutting down")

    def submit(self, job: Job) -> None:
        """Queue a request, or raise ``NotReady`` / ``QueueFull`` at once."""
        with self._wake:
            self.accepting()
            waiting = len(self._waiting) - self._free
            if waiting >= self.max_waiting:
                raise QueueFull(
                    f"{waiting} requests are already waiting (--max-waiting {self.max_waiting})"
                )
            self._waiting.append(job)
            self.metrics.waiting.set(len(self._waiting))
            self._wake.notify()

    def _run(self) -> None:
        try:
            self.metrics.watch_compiles()
            self.pool.warm_up()
            self._observe_rows()
            self.ready.set()
            while not (decisions := self.channel.share(self._decide)).stop:
                self._carry_out(decisions)
        except Exception as error:  # the engine cannot go on: fail everyone, /health says why
            traceback.print_exc()
            # with the queue emptied under the same lock, no request is queued after it
            with self._wake:
                self.failure = f"engine failed: {type(error).__name__}: {error}"
                jobs = [*self._running(), *self._waiting, *self._admitting]
                self.pool.release_all()
                self._waiting.clear()
                self._admitting = []
            for job in jobs:
                job.deliver(Event([], error=self.failure))

    def _decide(self) -> Decisions:
        """The next step's decisions, on this process's clock (it leads); while
        idle, waits a little for work (not after a fault: the reset comes at
        once, so /health tells a pool that cannot be reset right away)."""
        if self._fault is None and not self.pool.busy and not self.pool.in_flight:
            with self._wake:
                if not self._waiting and not self._stopping.is_set():
                    self._wake.wait(IDLE_WAIT)
        if self._stopping.is_set():
            return Decisions(stop=True)
        if self._fault is not None:
            return Decisions(reset=True)
        now = time.monotonic()
        release = tuple(row for row, job in self.pool.owners() if self._ends(job, now))
        # one step under the lock: a request submitted meanwhile sees the rows these take
        with self._wake:
            self._waiting = collections.deque(
                job for job in self._waiting if not self._ends(job, now)
            )
            free = len(self.pool.free_rows()) + len(release)
            # in order, while each finds a row and its pages: the rest wait
            admissible = self.pool.admissible([job.request for job in self._waiting], release)
            self._admitting = [self._waiting.popleft() for _ in range(admissible)]
            self._free = free - len(self._admitting)
            self.metrics.waiting.set(len(self._waiting))
        return Decisions(release=release, admit=tuple(j.request for j in self._admitting))

    def _ends(self, job: Job, now: float) -> bool:
        """Whether a running or waiting request ends before this step: cancelled,
        or timed out or past the drain deadline (it is told which)."""
        if job.cancelled:
            return True
        aborting = self._drain_deadline is not None and now > self._drain_deadline
        if aborting or job.expired(now):
            job.deliver(Event([], finish="abort" if aborting else "timeout"))
            return True
        return False

    def _carry_out(self, decisions: Decisions) -> None:
        """One step as decided: reset or free rows, admit, then a round if any row is busy."""
        if decisions.reset:
            self._reset()
        elif self._fault is not None:  # a follower's own fault: its state is no longer process 0's
            raise RuntimeError(
                f"this process faulted in a step where process 0 did not: {self._fault}"
            )
        for row in decisions.release:
            self.pool.release(row)
        if not self.channel.leads:  # process 0 answers them
            self._admitting = [Job(request, _nowhere) for request in decisions.admit]
        self._count_free()
        self._observe_rows()
        if self._guarded(self._admit) and self.driver.running:
            self._guarded(self._round)

    def _guarded(self, step: Callable[[], None]) -> bool:
        """Run ``step`` (whether it ran through); if the engine raises, fail the requests the pool
        held (a 500 each): the next step starts the pool afresh (its state may be half-donated)."""
        try:
            step()
        except Exception as error:
            traceback.print_exc()
            self._fault = f"engine fault in a round: {type(error).__name__}: {error}"
            self._fail_held(self._fault)
            return False
        return True

    def _fail_held(self, message: str) -> None:
        jobs = [*self._running(), *self._admitting]
        self.pool.release_all()
        self._admitting = []
        for job in jobs:
            job.deliver(Event([], error=message))
        self.metrics.running.set(0)

    def _reset(self) -> None:
        """Every row free in a fresh pool; a pool that
        cannot be made afresh is fatal (it raises)."""
        self._fail_held(self._fault or "engine fault in a round on process 0")
        self._fault = None
        self.pool.reset()
        self._count_free()

    def _observe_rows(self) -> None:
        self.metrics.running.set(self.pool.busy)
        self.metrics.cache_usage.set(self.pool.cache_usage)
        pages = self.pool.pages
        self.metrics.pages.counts = (pages.free, pages.cached, pages.held)

    def _count_free(self) -> None:
        with self._wake:
            self._free = len(self.pool.free_rows()) - len(self._admitting)

    def _admit(self) -> None:
        """Dispatch each decided request's prefill into a free row
        (its first token comes with the next round's report)."""
        while self._admitting:
            job = self._admitting[0]
            self.pool.admit([job.request], [job])
            self._admitting.pop(0)
            self.metrics.prompt_tokens.inc(len(job.request.prompt))
        self._observe_rows()

    def _round(self) -> None:
        """One step of the driver (``jaxdd.decoding.driver``): a round dispatched, the one before
        collected while it runs; rows that need no round (prompts scored alone) get their
        prefill's report without one. Hand every request its new tokens."""
        paused = self.pool.paused_rounds
        updates = self.driver.step()
        self.metrics.paused.inc(self.pool.paused_rounds - paused)
        self._observe_rows()  # before the tokens go out: a client that has its end sees it counted
        for update in updates.values():
            job = update.owner
            # the round's tokens: the accepted drafts and a bonus (none for a prompt scored alone)
            drafted = len(update.tokens) - update.first
            if update.proposed and drafted:  # a speculative round's (auto: not every one)
                self.metrics.drafts.inc()
                self.metrics.draft_tokens.inc(update.proposed)
                self.metrics.accepted_tokens.inc(drafted - 1)
            if drafted:
                self.metrics.acceptance.observe(drafted)
            self._hand(job, update)
        self._count_free()

    def _hand(self, job: Job, update: RowUpdate) -> None:
        now = time.monotonic()
        if update.first:
            job.first_token_at = now
            job.first_tokens = len(update.tokens)
            job.cached_tokens = update.cached_tokens
            self.metrics.ttft.observe(now - job.arrived)
            if self.pool.prefix_cache:
                self.metrics.prefix_queries.inc(len(job.request.prompt))
                self.metrics.prefix_hits.inc(update.cached_tokens)
        self.metrics.generation_tokens.inc(len(update.tokens))
        if update.finish is not None and update.produced > job.first_tokens:
            self.metrics.tpot.observe(
                (now - job.first_token_at) / (update.produced - job.first_tokens)
            )
        if not job.cancelled:
            scores = {"logprobs": update.logprobs, "prompt_logprobs": update.prompt_logprobs}
            job.deliver(Event(update.tokens, finish=update.finish, **scores))
