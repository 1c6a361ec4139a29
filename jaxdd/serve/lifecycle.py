"""Start-up and shutdown. Until the scheduler is ready (loading, joining a job, compiling),
SIGTERM or SIGINT ends the process at once: one line, exit 143 / 130 (``StartUp``). The listening
socket is bound before anything loads (``listen``). Once serving, the first SIGTERM or SIGINT
drains, a second one exits at once. In a job of several processes only process 0 decides when the
job stops: a follower's first signal waits for it (process 0's drain ends the job).

Draining stops admitting (the listening socket closes; a request on an open
connection gets a 503), lets the requests already queued or running finish, and ends
whatever still runs after ``--drain-timeout`` seconds with finish reason "abort", so
every stream still closes with its last chunk and ``[DONE]``; then the process
exits 0. uvicorn's own handler would re-raise the signal after its shutdown (a SIGTERM
exit, not 0) and lets only SIGINT force an exit, so the server replaces it.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

from jaxdd.errors import InputError
from jaxdd.runtime.startup import STOPPED, end_now
from jaxdd.serve.scheduler import Scheduler

# seconds past the drain timeout for ended streams to send their last chunks before uvicorn cancels
GRACE = 5.0


class StartUp:
    """From its creation until ``ready()``, SIGTERM or SIGINT ends the process at once
    (``end_now``: no unwinding under XLA's compiling threads, which aborts). Python runs a handler
    only between the main thread's bytecodes, and that thread waits in C++ while weights load or a
    job assembles: a thread reads each signal's number from Python's wakeup fd and ends the process
    itself."""

    def __init__(self) -> None:
        self.ready: Callable[[], bool] = lambda: False  # the scheduler's, once there is one
        signal.signal(signal.SIGTERM, end_now)
        signal.signal(signal.SIGINT, end_now)
        reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        watch = threading.Thread(target=self._watch, args=(reader,), daemon=True)
        watch.start()

    def _watch(self, reader: socket.socket) -> None:
        while numbers := reader.recv(64):
            for sig in numbers:
                if sig in STOPPED and not self.ready():
                    end_now(sig)


def listen(host: str, port: int) -> socket.socket:
    """The listening socket on ``host``:``port``; an InputError naming the host when it does not
    resolve, or the address when it cannot be bound (in use, not this host's)."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, protocol, _, address = found[0]
    except socket.gaierror as error:
        raise InputError(f"--host {host}: {error.strerror}") from None
    listener = socket.socket(family, kind, protocol)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds its own
    try:
        listener.bind(address)
        listener.listen(2048)
    except OSError as error:
        listener.close()
        raise InputError(f"{host}:{port}: {error.strerror}") from None
    return listener


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, drain_timeout: float, say):
        super().__init__(config)
        self.scheduler = scheduler
        self.drain_timeout = drain_timeout
        self.announcement: str | None = say  # printed once /health answers 200

    async def on_tick(self, counter: int) -> bool:
        if self.announcement is not None and self.scheduler.ready.is_set():
            print(f"jaxdd: note: {self.announcement}", file=sys.stderr, flush=True)
            self.announcement = None
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.scheduler.ready.is_set():
            end_now(sig)  # still compiling: nothing to drain
        name = signal.Signals(sig).name
        if self.should_exit:
            print(
                f"jaxdd: {name} again: exiting now, without draining", file=sys.stderr, flush=True
            )
            os._exit(128 + sig)
        print(
            f"jaxdd: note: {name}: draining (at most {self.drain_timeout:g} s)",
            file=sys.stderr,
            flush=True,
        )
        self.scheduler.drain(self.drain_timeout)
        self.should_exit = True


def serve(
    app: FastAPI,
    scheduler: Scheduler,
    listener: socket.socket,
    drain_timeout: float,
    say: str,
) -> None:
    """Serve on ``listener`` until a signal, then drain (returns once every connection is closed);
    print ``say`` once the scheduler is ready."""
    grace = drain_timeout + GRACE
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=grace)
    DrainingServer(config, scheduler, drain_timeout, say).run(sockets=[listener])


def defer_to_process_0() -> None:
    """A follower's signals: the first SIGTERM or SIGINT is noted
    and waits for process 0's stop; a second exits at once."""
    received: list[int] = []

    def handle(sig: int, frame: FrameType | None) -> None:
        name = signal.Signals(sig).name
        if received:
            print(
                f"jaxdd: {name} again: exiting now, without process 0", file=sys.stderr, flush=True
            )
            os._exit(128 + sig)
        received.append(sig)
        print(
            f"jaxdd: note: {name}: process 0 decides when the job stops (again: exit now)",
            file=sys.stderr,
            flush=True,
        )

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handle)
