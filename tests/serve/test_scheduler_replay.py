"""One scheduler, one meaning: a follower fed process 0's broadcast decisions
makes the same pool calls in the same order (admissions, releases, rounds, a
reset after a fault on both), and stops when process 0 does; a follower that
faults alone says so and stops. A fake pool stands in for the model (no JAX)."""

from __future__ import annotations

import collections
import threading
import time
import types

from jaxdd.decoding.requests import RowRequest, RowUpdate
from jaxdd.decoding.sampling import Sampling
from jaxdd.decoding.speculation import Chooser
from jaxdd.serve.decisions import Broadcast
from jaxdd.serve.metrics import Metrics
from jaxdd.serve.scheduler import Event, Job, Scheduler

ROWS, MAX_PROMPT = 2, 8


class FakePool:
    """A RowPool's bookkeeping: each round gives every busy row one token (the
    first with its prefill's), a row ends at its length; every call that a device
    would see is logged. ``faulty``: the dispatches (counted from 1) that raise."""

    shape = types.SimpleNamespace(rows=ROWS, spec=types.SimpleNamespace(block=4))
    prefix_cache = False
    cache_tokens, cache_usage = 64 * ROWS, 0.0  # a row's worth of pages each: rows decide
    paused_rounds = 0  # so no row waits for pages
    chooser = Chooser(("dflash-4",))  # one round: what /metrics counts

    def __init__(self, faulty: frozenset[int] = frozenset()):
        self.rows, self.faulty, self.dispatches = ROWS, faulty, 0
        self.active: dict[int, list] = {}  # row -> [max new tokens, produced, owner]
        self.log: list[tuple] = []
        self._in_flight: collections.deque[dict] = collections.deque()

    @property
    def pages(self) -> types.SimpleNamespace:  # a page per row
        busy = len(self.active)
        return types.SimpleNamespace(free=self.rows - busy, cached=0, held=busy)

    def warm_up(self) -> None:
        self.log.append(("warm_up",))

    def free_rows(self) -> list[int]:
        return [row for row in range(self.rows) if row not in self.active]

    def admissible(self, requests: list[RowRequest], release: tuple[int, ...] = ()) -> int:
        return min(len(self.free_rows()) + len(set(release) & set(self.active)), len(requests))

    def admit(self, requests: list[RowRequest], owners: list) -> list[int]:
        [request], [owner] = requests, owners
        row = self.free_rows()[0]
        prompt, stop_ids = tuple(request.prompt), tuple(request.stop_ids)
        self.log.append(("admit", row, prompt, request.max_new_tokens, stop_ids, request.sampling))
        self.active[row] = [request.max_new_tokens, 0, owner]
        return [row]

    def owners(self) -> list[tuple[int, object]]:
        return [(row, entry[2]) for row, entry in self.active.items()]

    @property
    def busy(self) -> int:
        return len(self.active)

    def release_all(self) -> None:
        self.active.clear()

    def release(self, row: int) -> None:
        self.log.append(("release", row))
        self.active.pop(row, None)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def needs_round(self) -> bool:
        return bool(self.active)  # here every token, the first too, comes from a round

    def dispatch(self) -> None:
        self.dispatches += 1
        self.log.append(("dispatch", tuple(sorted(self.active))))
        if self.dispatches in self.faulty:
            raise RuntimeError("injected")
        self._in_flight.append(dict(self.active))

    def collect(self) -> dict[int, RowUpdate]:
        self.log.append(("collect",))
        updates = {}
        for row, entry in self._in_flight.popleft().items():
            if self.active.get(row) is not entry:
                continue
            entry[1] += 1
            finish = "length" if entry[1] >= entry[0] else None
            updates[row] = RowUpdate(
                [row], finish, first=entry[1] == 1, produced=entry[1], owner=entry[2]
            )
            if entry[1] >= entry[0]:
                del self.active[row]
        return updates

    def reset(self) -> None:
        self.log.append(("reset",))
        self.active.clear()
        self._in_flight.clear()


def lead(
    pool: FakePool, jobs: list[tuple[list[int], int, Sampling]]
) -> tuple[list[list[Event]], list]:
    """Serve ``jobs`` (all at once) on a leading scheduler until each has ended, the last
    one cancelled by its client after two events: (each job's events, what it broadcast)."""
    sent = []
    channel = Broadcast(
        ROWS, MAX_PROMPT, 3600, leads=True, broadcast=lambda values: sent.append(values) or values
    )
    scheduler = Scheduler(pool, Metrics(pool.shape.spec.block), max_waiting=16, channel=channel)
    scheduler.start()
    assert scheduler.ready.wait(10)
    events: list[list[Event]] = [[] for _ in jobs]
    ended = threading.Semaphore(0)

    def deliver(i: int, event: Event) -> None:
        events[i].append(event)
        if event.finish is not None or event.error is not None:
            ended.release()
        elif i == len(jobs) - 1 and len(events[i]) == 2:
            submitted[i].cancel()
            ended.release()

    submitted = []
    for i, (prompt, max_new_tokens, sampling) in enumerate(jobs):
        submitted.append(
            Job(
                RowRequest(prompt, max_new_tokens, [0], sampling),
                lambda event, i=i: deliver(i, event),
            )
        )
        scheduler.submit(submitted[-1])
    for _ in jobs:
        assert ended.acquire(timeout=10)
    time.sleep(0.2)  # a few idle steps too
    scheduler.stop()
    return events, sent


def follow(pool: FakePool, sent: list) -> tuple[Scheduler, int]:
    """Run a follower on ``sent`` until it stops: (its scheduler, the broadcasts it left unread)."""
    replay = iter(sent)
    channel = Broadcast(ROWS, MAX_PROMPT, 3600, leads=False, broadcast=lambda _: next(replay))
    scheduler = Scheduler(pool, Metrics(pool.shape.spec.block), max_waiting=16, channel=channel)
    scheduler.start()
    scheduler.join()
    return scheduler, len(list(replay))


JOBS = [
    ([5, 6], 6, Sampling()),
    ([7], 1, Sampling()),  # ends at its first token
    ([8, 9, 10], 4, Sampling(0.7, 0.9, 0, 3)),
    ([11], 9, Sampling(1.0, seed=2**32 - 1)),  # cancelled after two events: its row is released
]


def test_a_follower_makes_process_0s_pool_calls():
    leader = FakePool(faulty=frozenset({3}))
    events, sent = lead(leader, JOBS)
    assert any(e.error for job in events for e in job) and any(
        e.finish == "length" for job in events for e in job
    )
    assert ("reset",) in leader.log and any(call[0] == "release" for call in leader.log)
    follower = FakePool(faulty=frozenset({3}))  # one program: the fault is everyone's
    scheduler, unread = follow(follower, sent)
    assert scheduler.failure is None and unread == 0 and follower.log == leader.log


def test_a_follower_that_faults_alone_stops():
    _, sent = lead(FakePool(), JOBS)
    scheduler, unread = follow(FakePool(faulty=frozenset({2})), sent)
    assert (
        unread > 0 and "this process faulted in a step where process 0 did not" in scheduler.failure
    )
