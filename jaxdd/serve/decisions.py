"""What the scheduler decides between two rounds, and
how every process of a job gets process 0's decisions.

A job of several processes runs one program on the global mesh: each process must
make the same jitted calls in the same order. So only process 0 decides (which rows
to free, which waiting requests to admit, whether to reset the pool after a fault,
when to stop), on its own clock, and before each step broadcasts the decisions to
the others, which carry them out as process 0 does. The broadcasts have fixed shapes
(a header, then one padded record per admitted request), so each compiles once; each is a
numpy record type with named fields, packed into the int32 words a broadcast carries.
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


def header_record(rows: int) -> np.dtype:
    """A step's header: whether to stop and to reset, how many rows are released and how many
    admission records follow, then the released rows (-1 past them)."""
    counts = [(name, np.int32) for name in ("stop", "reset", "released", "admitted")]
    return np.dtype([*counts, ("rows", np.int32, (rows,))])


def encode_header(decisions: Decisions, rows: int) -> np.ndarray:
    header = np.zeros((), header_record(rows))
    header["stop"], header["reset"] = decisions.stop, decisions.reset
    header["released"], header["admitted"] = len(decisions.release), len(decisions.admit)
    header["rows"] = -1
    header["rows"][: len(decisions.release)] = decisions.release
    return _words(header)


def decode_header(words: np.ndarray) -> tuple[bool, bool, tuple[int, ...], int]:
    """(stop, reset, released rows, number of admission records to follow)."""
    header = _record(words, header_record(len(words) - 4))
    released = tuple(int(r) for r in header["rows"][: header["released"]])
    return bool(header["stop"]), bool(header["reset"]), released, int(header["admitted"])


def admission_record(max_prompt: int) -> np.dtype:
    """An admission: its counts, its sampling settings (the floats as process 0 parsed them),
    its logprobs (-1: none) and whether its prompt is scored, then its stop ids and its prompt
    (padded: one size per server)."""
    return np.dtype(
        [
            ("prompt_length", np.int32),
            ("max_new_tokens", np.int32),
            ("stops", np.int32),
            ("top_k", np.int32),
            ("seed", np.uint32),
            ("temperature", np.float64),
            ("top_p", np.float64),
            ("logprobs", np.int32),
            ("score_prompt", np.int32),
            ("stop_ids", np.int32, (MAX_STOP_TOKENS,)),
            ("prompt", np.int32, (max_prompt,)),
        ]
    )


def admission_size(max_prompt: int) -> int:
    """Words (int32) of an admission record."""
    return admission_record(max_prompt).itemsize // 4


def encode_admission(admission: RowRequest, max_prompt: int) -> np.ndarray:
    record = np.zeros((), admission_record(max_prompt))
    sampling = admission.sampling
    record["prompt_length"], record["max_new_tokens"] = (
        len(admission.prompt),
        admission.max_new_tokens,
    )
    record["stops"], record["top_k"], record["seed"] = (
        len(admission.stop_ids),
        sampling.top_k,
        sampling.seed,
    )
    record["temperature"], record["top_p"] = sampling.temperature, sampling.top_p
    record["logprobs"] = -1 if admission.logprobs is None else admission.logprobs
    record["score_prompt"] = admission.score_prompt
    record["stop_ids"][: len(admission.stop_ids)] = admission.stop_ids
    record["prompt"][: len(admission.prompt)] = admission.prompt
    return _words(record)


def decode_admission(words: np.ndarray) -> RowRequest:
    record = _record(words, admission_record(len(words) - admission_size(0)))
    sampling = Sampling(
        float(record["temperature"]),
        float(record["top_p"]),
        int(record["top_k"]),
        int(record["seed"]),
    )
    prompt = [int(t) for t in record["prompt"][: record["prompt_length"]]]
    stop_ids = [int(t) for t in record["stop_ids"][: record["stops"]]]
    logprobs = None if record["logprobs"] < 0 else int(record["logprobs"])
    max_new_tokens, score = int(record["max_new_tokens"]), bool(record["score_prompt"])
    return RowRequest(prompt, max_new_tokens, stop_ids, sampling, logprobs, score)


def _words(record: np.ndarray) -> np.ndarray:
    """A record as the int32 words a broadcast carries (its dtype packs its fields)."""
    return np.frombuffer(record.tobytes(), np.int32).copy()


def _record(words: np.ndarray, dtype: np.dtype) -> np.void:
    """The record of ``dtype`` that ``_words`` made ``words``."""
    return np.frombuffer(np.ascontiguousarray(words, np.int32).tobytes(), dtype)[0]
