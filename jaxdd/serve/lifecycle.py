"""Shutdown: the first SIGTERM or SIGINT drains, a second one exits at once. In a job of several processes only
process 0 decides when the job stops: a follower's first signal waits for it (process 0's drain ends the job).

Draining stops admitting (the listening socket closes; a request on an open connection gets a 503), lets the
requests already queued or running finish, and ends whatever still runs after ``--drain-timeout`` seconds with
finish reason "abort", so every stream still closes with its last chunk and ``[DONE]``; then the process exits 0.
uvicorn's own handler would re-raise the signal after its shutdown (a SIGTERM exit, not 0) and lets only SIGINT
force an exit, so the server replaces it.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

import uvicorn
from fastapi import FastAPI

from jaxdd.serve.scheduler import Scheduler

GRACE = 5.0  # seconds past the drain timeout for ended streams to send their last chunks before uvicorn cancels


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, drain_timeout: float):
        super().__init__(config)
        self.scheduler, self.drain_timeout = scheduler, drain_timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        name = signal.Signals(sig).name
        if self.should_exit:
            print(f"jaxdd: {name} again: exiting now, without draining", file=sys.stderr, flush=True)
            os._exit(128 + sig)
        print(f"jaxdd: note: {name}: draining (at most {self.drain_timeout:g} s)", file=sys.stderr, flush=True)
        self.scheduler.drain(self.drain_timeout)
        self.should_exit = True


def serve(app: FastAPI, scheduler: Scheduler, host: str, port: int, drain_timeout: float) -> None:
    """Serve until a signal, then drain (returns once every connection is closed)."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=drain_timeout + GRACE
    )
    DrainingServer(config, scheduler, drain_timeout).run()


def defer_to_process_0() -> None:
    """A follower's signals: the first SIGTERM or SIGINT is noted and waits for process 0's stop; a second exits
    at once."""
    received: list[int] = []

    def handle(sig: int, frame: FrameType | None) -> None:
        name = signal.Signals(sig).name
        if received:
            print(f"jaxdd: {name} again: exiting now, without process 0", file=sys.stderr, flush=True)
            os._exit(128 + sig)
        received.append(sig)
        print(f"jaxdd: note: {name}: process 0 decides when the job stops (again: exit now)", file=sys.stderr,
              flush=True)  # fmt: skip

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handle)
