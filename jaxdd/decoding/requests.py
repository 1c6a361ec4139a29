"""What a pool of rows takes and gives (``jaxdd.decoding.rows``): a checked request, the pool's
fixed shape, a row's update after a collect, what the pool needs of its decoder, and requests
as a prefill's host arrays."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxdd.cache import Paging
from jaxdd.config import KimiConfig
from jaxdd.decoding.programs import names_formats, state_formats
from jaxdd.decoding.report import RoundTrace, TokenLogprob
from jaxdd.decoding.sampling import GREEDY, Sampling, seed_keys
from jaxdd.decoding.state import DecodeState, ModelPair, RoundSpec, state_shardings
from jaxdd.models.drafter import DFlashDrafter
from jaxdd.runtime.buckets import prompt_buckets
from jaxdd.types import Method, verified_tokens


class Decoder(Protocol):
    """What the rows need of ``SpeculativeDecoder``: the
    models, their placement and the round's static form."""

    config: KimiConfig
    drafter: DFlashDrafter | None
    mesh: jax.sharding.Mesh | None
    target: Any  # has .model, the KimiTarget

    def round_spec(self, method: Method, **options) -> RoundSpec: ...

    def models_for(self, spec: RoundSpec) -> ModelPair: ...

    def empty_state(self, shape: RowShape) -> DecodeState: ...


@dataclasses.dataclass(frozen=True)
class RowRequest:
    """One request, made once by its caller (the server from an HTTP body, ``generate_batch``
    from its arguments) and checked once (``checks.check_request``): its stop ids those it asks
    for, once checked with its caller's own (the model's EOS ids) among them."""

    prompt: list[int]
    max_new_tokens: int  # 0 only with ``score_prompt``: the prompt scored alone
    stop_ids: list[int]
    sampling: Sampling = GREEDY
    logprobs: int | None = None  # each new token's logprob and this many top ones; None: none
    score_prompt: bool = False  # the prompt's logprobs too (a scoring prefill)


@dataclasses.dataclass
class RowEntry:
    """A request in a row: what it asked for and what its rounds gave it so far."""

    max_new_tokens: int
    owner: Any = None
    produced: int = 0
    logprobs: int | None = None  # the request's top-k (None: no logprobs)
    scored_prompt: int = 0  # the prompt's length if it is scored, else 0
    request: RowRequest | None = None
    output: list[int] = dataclasses.field(default_factory=list)  # the tokens collected
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    chunked: bool = False  # prefilled in chunks of ``prefill_chunk`` tokens
    next: int | None = None  # where its next prefill part starts (None: prefilled)


@dataclasses.dataclass(frozen=True)
class RowShape:
    """Everything fixed about a pool: its rounds, rows,
    cache size and what a request may ask for."""

    spec: RoundSpec  # the round while any busy row samples
    # the round while every busy row is greedy (``spec`` itself for a one-round pool)
    greedy_spec: RoundSpec
    rows: int
    max_len: int  # prompt + new tokens, per request
    max_prompt: int
    tiers: tuple[int, ...]  # the row counts a round runs over: the fewest that hold every busy row
    # the rows' tables and the pool of pages they share; its rows' slots are the most a
    # request's tokens and a round's writes reach
    paging: Paging
    prefill_chunk: int | None = None  # a longer prompt is prefilled in parts of this many tokens

    @property
    def slots(self) -> int:
        return self.paging.slots

    @property
    def round_tokens(self) -> int:
        """Slots a round writes past a row's committed tokens: a draft block, or a verify's."""
        spec = self.spec
        return max(spec.block, verified_tokens(spec.method, spec.block, spec.budget))

    def reach(self, request: RowRequest) -> int:
        """The slots ``request``'s row can write: its tokens and a round's past the last."""
        return min(len(request.prompt) + request.max_new_tokens + self.round_tokens, self.slots)

    def start(self, request: RowRequest) -> int:
        """The slots ``request``'s row takes when admitted: its prompt and its first round's."""
        return min(len(request.prompt) + self.round_tokens, self.reach(request))

    def state_maker(self, decoder: Decoder) -> Callable[[], DecodeState]:
        """A jitted call making this shape's decode state, every row done (nothing to decode)
        until a request is inserted, straight into its shardings (no device holds more than its
        share of the pool, even for a moment); ``decoder.empty_state`` keeps one per shape."""
        empty, mesh = self._empty(decoder), decoder.mesh
        placed = self.formats(decoder)
        if placed is None and mesh is not None:
            placed = state_shardings(jax.eval_shape(empty), mesh)
        return jax.jit(empty, out_shardings=placed)

    def formats(self, decoder: Decoder) -> DecodeState | None:
        """The formats this shape's state needs named (``jaxdd.decoding.programs``), or None."""
        if not names_formats(decoder.mesh):
            return None
        return state_formats(jax.eval_shape(self._empty(decoder)), decoder.mesh)

    def _empty(self, decoder: Decoder) -> Callable[[], DecodeState]:
        spec = self.spec
        drafter = None if spec.method == "ar" else decoder.drafter.config
        sizes = (self.rows, self.paging, spec.block)
        dtype = decoder.target.model.dtype
        layout = {"stripes": spec.stripes, "drafter_kv": spec.drafter_kv}

        def empty() -> DecodeState:
            keys = seed_keys(jnp.zeros((self.rows,), jnp.uint32))
            state = DecodeState.empty(decoder.config, drafter, *sizes, dtype, keys, **layout)
            return state.replace(done=jnp.ones((self.rows,), bool))

        return empty

    def buckets(self) -> list[int]:
        """The lengths a prompt (or the rest of one after a hit) is padded to."""
        return prompt_buckets(self.max_prompt)

    def warm_up_requests(self, prefix_cache: bool) -> list[RowRequest]:
        """``warm_up_requests`` for this shape."""
        scoring = bool(self.spec.top_logprobs)
        return warm_up_requests(
            self.max_prompt, self.paging.page, scoring, prefix_cache, self.prefill_chunk
        )


def warm_up_requests(
    max_prompt: int, page: int, scoring: bool, prefix_cache: bool, prefill_chunk: int | None
) -> list[RowRequest]:
    """Greedy one-token requests that, admitted in turn, run every prefill a pool runs: each
    bucket's whole prompt (``scoring``: and its scoring one); with the prefix cache, a page
    cached and then after it a rest of each bucket's size (each rest its own: no longer hit);
    with chunks, a prompt past one."""
    buckets, scores = prompt_buckets(max_prompt), (False, True) if scoring else (False,)
    requests = []
    for i, (n, score) in enumerate(itertools.product(buckets, scores)):
        prompt = [4 + i] + [1] * (min(n, max_prompt) - 1)  # none finds another's pages
        requests.append(RowRequest(prompt, 1, [], GREEDY, 0 if score else None, score))
    hit, after_hit, again = [2] * page, max_prompt - page, []
    if prefix_cache and after_hit > 0:
        rests = [[5 + i] * min(b, after_hit) for i, b in enumerate(buckets)]
        again = [[*hit, 3]] + [hit + rest for rest in rests]
    chunk = prefill_chunk or max_prompt
    again += [[3] * (chunk + 1)] if chunk < max_prompt else []
    return requests + [RowRequest(prompt, 1, [], GREEDY) for prompt in again]


@dataclasses.dataclass(frozen=True)
class RowUpdate:
    """What a row got since the last collect: its new tokens (``first``: the first of
    them is the prefill's, the request's first token; the rest are one round's), once
    it ends why ("stop" or "length"), with a trace the round's (``RoundTrace``), the
    tokens its request has now, and that request's owner (as given to ``admit``). If
    the request asked, ``logprobs`` has an entry per new token and ``prompt_logprobs``
    (in the request's first update) one per prompt token after the first. ``cached_tokens``: the
    prompt tokens its row found in the prefix cache; ``proposed``: the draft tokens the round
    proposed (0: a plain round's, or the prefill's alone)."""

    tokens: list[int]
    finish: str | None = None
    first: bool = False
    trace: RoundTrace | None = None
    produced: int = 0
    owner: Any = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    cached_tokens: int = 0
    proposed: int = 0

    def then(self, later: RowUpdate) -> RowUpdate:
        """This update and ``later`` as one (a collect's reports for a row): the tokens and their
        logprobs of both, the first token and the prompt's logprobs of this one."""
        logprobs = None if later.logprobs is None else self.logprobs + later.logprobs
        return dataclasses.replace(
            later,
            tokens=self.tokens + later.tokens,
            first=self.first,
            prompt_logprobs=self.prompt_logprobs,
            logprobs=logprobs,
        )


def pad_requests(
    requests: list[RowRequest], rows: int, length: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The prefill's host inputs for ``requests`` in the first of ``rows``
    rows, prompts padded to ``length``: (tokens, prompt_len, seeds). Padding
    rows hold one token (their requests' length ends them at once)."""
    tokens = np.zeros((rows, length), np.int32)
    prompt_len = np.ones((rows,), np.int32)
    seeds = np.zeros((rows,), np.uint32)
    for i, request in enumerate(requests):
        tokens[i, : len(request.prompt)] = request.prompt
        prompt_len[i] = len(request.prompt)
        seeds[i] = request.sampling.seed
    return tokens, prompt_len, seeds
