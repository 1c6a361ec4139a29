"""What the scheduler decides between two rounds, and
how every process of a job gets process 0's decisions.

A job of several processes runs one program on the global mesh: each process must
make the same jitted calls in the same order. So only process 0 decides (which rows
to free, which waiting requests to admit, whether to reset the pool after a fault,
when to stop), on its own clock, and before each step broadcasts the decisions to
the others, which carry them out as process 0 does. The broadcasts have fixed shapes
(a header, then one padded record per admitted request), so each compiles once.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

import numpy as np
from jax.experimental import multihost_utils

from jaxdd.decoding.checks import MAX_STOP_TOKENS
from jaxdd.decoding.requests import RowRequest
from jaxdd.decoding.sampling import Sampling

LOST = 1  # the exit code of a follower that stopped hearing from process 0


@dataclasses.dataclass(frozen=True)
class Decisions:
    """One step's decisions: stop, or reset the pool (after a fault), free ``release``'s
    rows, then admit ``admit`` in order (each into the lowest free row): what every process
    needs of a request to admit it, its tokens and settings, not its connection."""

    stop: bool = False
    reset: bool = False
    release: tuple[int, ...] = ()
    admit: tuple[RowRequest, ...] = ()


class Local:
    """One process: its decisions are everyone's."""

    leads = True

    def share(self, decide: Callable[[], Decisions]) -> Decisions:
        return decide()


class Broadcast:
    """Several processes: process 0 decides and broadcasts; the others receive. A
    follower whose broadcast fails (process 0 vanished) or that waits ``timeout``
    seconds for process 0's next decisions (it hangs) says so in one line and
    exits ``LOST``; the steps themselves (a long prefill) take what they take.
    ``broadcast``: process 0's array on every process (a stand-in in tests)."""

    def __init__(
        self,
        rows: int,
        max_prompt: int,
        timeout: float,
        leads: bool,
        broadcast: Callable[[np.ndarray], np.ndarray] | None = None,
    ):
        self.rows = rows
        self.max_prompt = max_prompt
        self.timeout = timeout
        self.leads = leads
        self._broadcast = broadcast or from_process_0
        # since when a follower waits for process 0's decisions
        self._waiting_since: float | None = None
        if not self.leads:
            threading.Thread(
                target=self._watch, name="jaxdd-follower-watchdog", daemon=True
            ).start()

    def share(self, decide: Callable[[], Decisions]) -> Decisions:
        if self.leads:
            decisions = decide()
            self._broadcast(encode_header(decisions, self.rows))
            for request in decisions.admit:
                self._broadcast(encode_admission(request, self.max_prompt))
            return decisions
        self._waiting_since = time.monotonic()
        try:
            stop, reset, release, admitted = decode_header(
                self._broadcast(encode_header(Decisions(), self.rows))
            )
            blank = np.zeros((admission_size(self.max_prompt),), np.int32)
            admit = tuple(decode_admission(self._broadcast(blank)) for _ in range(admitted))
        # at once: JAX's own client aborts the process with a stack trace soon after
        except Exception as error:
            _lost(
                f"lost process 0 ({type(error).__name__}: {(str(error).splitlines() or [''])[0]})"
            )
        self._waiting_since = None
        return Decisions(stop, reset, release, admit)

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            since = self._waiting_since
            if since is not None and time.monotonic() - since > self.timeout:
                # os._exit: the scheduler thread may be blocked
                # in a collective that nothing interrupts.
                _lost(f"process 0 sent nothing for {self.timeout:g} s")


def _lost(why: str) -> NoReturn:
    print(f"jaxdd: {why}: exiting", file=sys.stderr, flush=True)
    os._exit(LOST)


def from_process_0(values: np.ndarray) -> np.ndarray:
    return np.asarray(multihost_utils.broadcast_one_to_all(values))


HEADER = 4  # stop, reset, rows released, requests admitted; then the released rows


def encode_header(decisions: Decisions, rows: int) -> np.ndarray:
    header = np.full((HEADER + rows,), -1, np.int32)
    header[:HEADER] = decisions.stop, decisions.reset, len(decisions.release), len(decisions.admit)
    header[HEADER : HEADER + len(decisions.release)] = decisions.release
    return header


def decode_header(header: np.ndarray) -> tuple[bool, bool, tuple[int, ...], int]:
    """(stop, reset, released rows, number of admission records to follow)."""
    stop, reset, released, admitted = (int(v) for v in header[:HEADER])
    return (
        bool(stop),
        bool(reset),
        tuple(int(r) for r in header[HEADER : HEADER + released]),
        admitted,
    )


# An admission: prompt length, max new tokens, stop count, top_k, seed, temperature and top_p
# (float64, two words each: exactly the floats process 0 parsed), logprobs (-1: none), whether
# the prompt is scored, the stop ids, the prompt.
FIELDS = 11


def admission_size(max_prompt: int) -> int:
    return FIELDS + MAX_STOP_TOKENS + max_prompt


def encode_admission(admission: RowRequest, max_prompt: int) -> np.ndarray:
    record = np.zeros((admission_size(max_prompt),), np.int32)
    sampling = admission.sampling
    record[:4] = (
        len(admission.prompt),
        admission.max_new_tokens,
        len(admission.stop_ids),
        sampling.top_k,
    )
    record[4:5] = np.array([sampling.seed], np.uint32).view(np.int32)
    record[5:9] = np.array([sampling.temperature, sampling.top_p], np.float64).view(np.int32)
    record[9] = -1 if admission.logprobs is None else admission.logprobs
    record[10] = admission.score_prompt
    record[FIELDS : FIELDS + len(admission.stop_ids)] = admission.stop_ids
    start = FIELDS + MAX_STOP_TOKENS
    record[start : start + len(admission.prompt)] = admission.prompt
    return record


def decode_admission(record: np.ndarray) -> RowRequest:
    length, max_new_tokens, stops, top_k = (int(v) for v in record[:4])
    seed = int(record[4:5].view(np.uint32)[0])
    temperature, top_p = (float(v) for v in record[5:9].view(np.float64))
    logprobs = None if record[9] < 0 else int(record[9])
    start = FIELDS + MAX_STOP_TOKENS
    prompt = [int(t) for t in record[start : start + length]]
    stop_ids = [int(t) for t in record[FIELDS : FIELDS + stops]]
    sampling = Sampling(temperature, top_p, top_k, seed)
    return RowRequest(prompt, max_new_tokens, stop_ids, sampling, logprobs, bool(record[10]))
