"""Continuous batching: a fixed pool of rows in ONE decode state, requests coming and going between rounds.

Every shape is fixed when the pool is made: ``rows`` rows, one cache size for all (from ``max_len``), one prefill
per prompt bucket up to ``max_prompt``, and two rounds per tier: the sampled round, whose greedy rows still decode
greedily (their distributions are one-hot), and the cheaper greedy round, run while every active row is greedy
(the tokens are the same). A tier is the first 1, 4, 16, ... rows or all of them; a round runs over the fewest
that hold every busy row (requests take the lowest free row), so a lightly loaded pool pays for the rows it uses.

A request is prefilled on its own (batch 1, at the prompt bucket ``SpeculativeDecoder.start`` would pick) and
copied into a free row in the same jitted call, the row index traced and the state donated, so admitting never
compiles. Rows never mix: each row's tokens depend only on its own request and its random stream only on its own
seed and its own round count, so a request decodes to what it gives alone.

Nothing waits on the device between rounds: ``admit`` returns once the prefill is dispatched, and its first token
comes back with the report of the next round dispatched (``collect`` hands both at once), so an admission does not
drain rounds dispatched ahead (``dispatch`` twice, then ``collect`` the older one, so the host's bookkeeping
overlaps the device's round). A report is only handed to the requests that held its rows when it was dispatched.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxdd.decoding.engine import SpeculativeDecoder, cache_slots, prompt_bucket
from jaxdd.decoding.report import RoundReport
from jaxdd.decoding.requests import MAX_STOP_TOKENS, check_round_options, check_stop_ids, check_tokens
from jaxdd.decoding.rounds import (
    DecodeState,
    ModelPair,
    Requests,
    RoundSpec,
    decode_round,
    prefill,
    state_shardings,
)
from jaxdd.decoding.sampling import GREEDY, Sampling, SamplingArrays, seed_keys
from jaxdd.errors import InputError
from jaxdd.types import Method, verified_tokens


@dataclasses.dataclass(frozen=True)
class RowUpdate:
    """What a row got since the last collect: its new tokens (``first``: the first of them is the prefill's, the
    request's first token; the rest are one round's) and, once it ends, why ("stop" or "length")."""

    tokens: list[int]
    finish: str | None = None
    first: bool = False


@dataclasses.dataclass
class _Row:
    max_new_tokens: int
    produced: int = 0


class _Report(NamedTuple):
    """A device report and, for each row it was run for, (row, its line in the report, the request holding it)."""

    report: jax.Array
    holders: list[tuple[int, int, _Row]]


@functools.partial(jax.jit, static_argnames=("spec", "slots", "mesh"), donate_argnames=("state",))
def prefill_row(
    spec: RoundSpec,
    models: ModelPair,
    state: DecodeState,
    row: jax.Array,
    tokens: jax.Array,
    prompt_len: jax.Array,
    requests: Requests,
    seeds: jax.Array,
    slots: int,
    mesh: jax.sharding.Mesh | None,
) -> tuple[DecodeState, jax.Array]:
    """``prefill`` one request and put it in row ``row`` of ``state`` (in place: the state is donated): (state,
    the prefill's report)."""
    new, report = prefill(spec, models, tokens, prompt_len, requests, seeds, slots, mesh)
    state = jax.tree.map(lambda rows, one: jax.lax.dynamic_update_slice_in_dim(rows, one, row, axis=0), state, new)
    return state, report


@functools.partial(jax.jit, static_argnames=("spec", "rows"), donate_argnames=("state",))
def front_round(
    spec: RoundSpec, models: ModelPair, state: DecodeState, requests: Requests, rows: int
) -> tuple[DecodeState, jax.Array]:
    """``decode_round`` on the first ``rows`` rows only (the rest unchanged): while few rows are busy, a round
    costs what their number does, not the pool's."""
    front = jax.tree.map(lambda x: x[:rows], (state, requests))
    new, report = decode_round(spec, models, *front)
    update = lambda full, part: jax.lax.dynamic_update_slice_in_dim(full, part, 0, axis=0)
    return jax.tree.map(update, state, new), report


class RowPool:
    """``rows`` decode rows of one method; ``admit`` a request into a free row, ``step`` one round for all."""

    def __init__(
        self,
        decoder: SpeculativeDecoder,
        *,
        method: Method,
        rows: int,
        max_len: int,
        max_prompt: int | None = None,
        block_size: int | None = None,
        budget: int | None = None,
    ):
        config = decoder.config
        if rows < 1:
            raise InputError.at("rows", f"must be >= 1, got {rows}")
        if not 2 <= max_len <= config.max_position_embeddings:
            raise InputError.at("max_len", f"must be in [2, {config.max_position_embeddings}], got {max_len}")
        max_prompt = max_len - 1 if max_prompt is None else max_prompt
        if not 1 <= max_prompt < max_len:
            raise InputError.at("max_prompt", f"must be in [1, max_len), got {max_prompt}")
        drafter_block = None if decoder.drafter is None else decoder.drafter.config.block_size
        has_drafter = decoder.drafter is not None
        block, budget = check_round_options(method, has_drafter, drafter_block, block_size, budget, None)
        self.decoder, self.rows, self.max_len, self.max_prompt = decoder, rows, max_len, max_prompt
        self.method, self.block, self.budget = method, block, budget
        self.spec = decoder.round_spec(method, block, budget, sampled=True)
        self.greedy_spec = decoder.round_spec(method, block, budget, sampled=False)
        self.models = decoder._models_for(self.spec)
        self.buckets = sorted({prompt_bucket(n) for n in range(1, max_prompt + 1)})
        # Rounds over the first 1, 4, 16, ... rows and over all: requests take the lowest free row, so the round
        # runs over the rows up to the highest busy one.
        self.tiers = sorted({4**i for i in range(rows.bit_length()) if 4**i < rows} | {rows})
        self.slots = cache_slots(max(self.buckets[-1], max_len + max(block, verified_tokens(method, block, budget))))
        self.default_stop_ids = check_stop_ids(None, config)
        # Host copies of the per-row settings; the device copy is replaced whole at the first round after
        # admissions (a few hundred bytes), free rows keep their last request's settings: a done row changes
        # nothing whatever they say.
        self._max_length = np.full((rows,), 2, np.int32)
        self._stop_ids = np.full((rows, MAX_STOP_TOKENS), -1, np.int32)
        self._settings = [GREEDY] * rows
        self.requests: Requests | None = None  # the device copy, made when a round needs it
        self.state = self._empty_state()
        self.active: dict[int, _Row] = {}
        # Reports not yet read: the prefills since the last dispatch, and per round dispatched those before it
        # and its own.
        self._prefilled: list[_Report] = []
        self._in_flight: collections.deque[list[_Report]] = collections.deque()

    @property
    def width(self) -> int:
        """Tokens per report row: 1 for AR, else the block."""
        return self.spec.width

    def free_rows(self) -> list[int]:
        return [row for row in range(self.rows) if row not in self.active]

    def check(self, prompt: list[int], max_new_tokens: int, stop_ids: list[int], sampling: Sampling) -> None:
        """Raise ``InputError`` naming what in a request this pool cannot run (nothing is changed)."""
        check_tokens([prompt], self.decoder.config.vocab_size)
        if len(prompt) > self.max_prompt:
            raise InputError.at("prompt", f"{len(prompt)} tokens, this server admits at most {self.max_prompt}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InputError.at("max_tokens", f"must be an integer >= 1, got {max_new_tokens!r}")
        if len(prompt) + max_new_tokens > self.max_len:
            raise InputError.at(
                "max_tokens",
                f"{max_new_tokens} after a prompt of {len(prompt)} tokens exceeds the server's "
                f"--max-len {self.max_len}",
            )
        check_stop_ids(stop_ids, self.decoder.config)
        if not isinstance(sampling, Sampling):
            raise InputError.at("sampling", "expected a jaxdd.Sampling")

    def admit(self, prompt: list[int], max_new_tokens: int, stop_ids: list[int], sampling: Sampling) -> int:
        """Prefill a request alone into a free row, without waiting for it: its row. Its first token comes with
        the next round's tokens (``collect``)."""
        self.check(prompt, max_new_tokens, stop_ids, sampling)
        free = self.free_rows()
        if not free:
            raise InputError("no free row: admit only while free_rows() is not empty")
        row = free[0]
        padded = prompt_bucket(len(prompt))
        tokens = np.zeros((1, padded), np.int32)
        tokens[0, : len(prompt)] = prompt
        stops = np.full((1, MAX_STOP_TOKENS), -1, np.int32)
        stops[0, : len(stop_ids)] = stop_ids
        max_length = np.array([len(prompt) + max_new_tokens], np.int32)
        one = Requests(max_length, stops, SamplingArrays.of([sampling]))
        seeds = np.array([sampling.seed], np.uint32)
        prompt_len = np.array([len(prompt)], np.int32)
        mesh = self.decoder.mesh
        args = (self.spec, self.models, self.state, np.int32(row), tokens, prompt_len, one, seeds, self.slots, mesh)
        self.state, report = prefill_row(*args)
        self._max_length[row], self._stop_ids[row], self._settings[row] = max_length[0], stops[0], sampling
        self.requests = None
        self.active[row] = entry = _Row(max_new_tokens)
        self._prefilled.append(_Report(report, [(row, 0, entry)]))
        return row

    def release(self, row: int) -> None:
        """Free a row (a cancelled request): its device row keeps running until a new request overwrites it,
        which costs nothing extra (the round's shape is fixed) and touches no other row."""
        self.active.pop(row, None)

    def reset(self) -> None:
        """Every row free in a fresh state, nothing in flight: after a fault, the old state may have been donated
        to a call that never returned."""
        self.active.clear()
        self._prefilled.clear()
        self._in_flight.clear()
        self.state = self._empty_state()
        self.requests = None

    @property
    def in_flight(self) -> int:
        """Rounds dispatched and not yet collected."""
        return len(self._in_flight)

    def dispatch(self) -> None:
        """Start one round for every row without waiting for it: the greedy round while every active row is
        greedy, else the sampled one."""
        sampled = any(not self._settings[row].greedy for row in self.active)
        tier = next(t for t in self.tiers if t > max(self.active, default=0))
        self._run_round(self.spec if sampled else self.greedy_spec, tier)

    def _run_round(self, spec: RoundSpec, tier: int) -> None:
        if self.requests is None:
            self.requests = self._device_requests()
        if tier == self.rows:
            self.state, report = decode_round(spec, self.models, self.state, self.requests)
        else:
            self.state, report = front_round(spec, self.models, self.state, self.requests, tier)
        self._in_flight.append([*self._prefilled, _Report(report, [(row, row, e) for row, e in self.active.items()])])
        self._prefilled = []

    def collect(self) -> dict[int, RowUpdate]:
        """The oldest dispatched round's new tokens (after the first token of each row prefilled before it) for
        each row still held by the request it ran for; finished rows leave the pool."""
        updates: dict[int, RowUpdate] = {}
        for report, holders in self._in_flight.popleft():
            report = RoundReport.decode(report, self.width)
            for row, index, entry in holders:
                if self.active.get(row) is not entry:  # released, or already finished by an earlier report
                    continue
                tokens = report.emitted(index)
                first = entry.produced == 0
                entry.produced += len(tokens)
                stopped = bool(report.stopped[index])
                finish = "stop" if stopped else "length" if entry.produced >= entry.max_new_tokens else None
                if row in updates:
                    tokens, first = updates[row].tokens + tokens, updates[row].first
                updates[row] = RowUpdate(tokens, finish, first)
                if finish is not None:
                    del self.active[row]
        return updates

    def step(self) -> dict[int, RowUpdate]:
        """One round for every row, waited for (with nothing else in flight)."""
        self.dispatch()
        return self.collect()

    def _device_requests(self) -> Requests:
        return jax.device_put(Requests(self._max_length, self._stop_ids, SamplingArrays.of(self._settings)))

    def _empty_state(self) -> DecodeState:
        """Every row done (nothing to decode) until a request is inserted."""
        config = self.decoder.config
        drafter = None if self.spec.method == "ar" else self.decoder.drafter.config
        seeds = jnp.zeros((self.rows,), jnp.uint32)
        dtype = self.decoder.target.model.dtype
        state = DecodeState.empty(config, drafter, self.rows, self.slots, self.spec.block, dtype, seed_keys(seeds))
        state = state.replace(done=jnp.ones((self.rows,), bool))
        mesh = self.decoder.mesh
        return jax.device_put(state, state_shardings(state, mesh)) if mesh is not None else state

    def warm_up(self) -> None:
        """Compile every executable the pool will run: each prompt bucket's prefill and each tier's sampled and
        greedy rounds (twice each, so a second call finds what the first left: shardings and layouts settle after
        one)."""
        for _ in range(2):
            for padded in self.buckets:
                self.admit([1] * min(padded, self.max_prompt), 1, [], GREEDY)
                self.step()  # the first token ends it
            row = self.admit([1], min(self.width + 1, self.max_len - 1), [], GREEDY)
            for spec in (self.spec, self.greedy_spec):
                for tier in self.tiers:
                    self._run_round(spec, tier)
                    self.collect()
            self.release(row)
