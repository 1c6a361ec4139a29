"""The host side of decoding: requests in, tokens out. ``SpeculativeDecoder`` checks a batch of
requests, sizes a pool of rows for it (``jaxdd.decoding.rows``, the server's pool: batch, prompt
and cache buckets, so shapes repeat and compile once), admits them all in one prefill and steps
the pool as the server's scheduler does (``jaxdd.decoding.driver``: offline, every request
arrived at once) until every request is done, streaming each round's accepted tokens.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Literal, Protocol

import jax
import numpy as np

from jaxdd.cache.stripes import Stripes
from jaxdd.decoding.checks import (
    PoolOptions,
    Words,
    check_request,
    check_tree_logits,
    per_request,
    pool_shape,
)
from jaxdd.decoding.driver import Driver
from jaxdd.decoding.programs import programs_for
from jaxdd.decoding.report import RoundTrace, TokenLogprob
from jaxdd.decoding.requests import RowRequest, RowShape, RowUpdate
from jaxdd.decoding.round_size import RoundSizes
from jaxdd.decoding.rows import RowPool
from jaxdd.decoding.sampling import GREEDY, Sampling
from jaxdd.decoding.state import DecodeState, ModelPair, RoundSpec, RowSettings
from jaxdd.errors import InputError
from jaxdd.models.drafter import DFlashDrafter
from jaxdd.models.target import KimiTarget
from jaxdd.runtime.backend import Backend
from jaxdd.runtime.buckets import bucket
from jaxdd.runtime.compile_time import compile_clock
from jaxdd.runtime.jit_state import split_module
from jaxdd.runtime.sharding import mesh_of
from jaxdd.types import (
    ATTENTION_CHOICES,
    DRAFTER_KVS,
    LAYOUTS,
    AttentionChoice,
    CacheLayout,
    DrafterKV,
    Method,
    TreeLogits,
)

# where ``generate_batch`` names a field otherwise than jaxdd; a batch's pool is sized for its
# requests, so the one limit a request can pass is the model's
API_WORDS = Words(
    prompt="token_ids",
    stop_ids="stop_token_ids",
    max_len="the model's max_position_embeddings",
    max_prompt="the model's max_position_embeddings less a new token",
    max_logprobs="logprobs",
)


class LoadedTarget(Protocol):
    """What the decoder needs of a target: ``jaxdd.Target`` is one."""

    model: KimiTarget


@dataclasses.dataclass
class Generation:
    """What ``generate`` returns: new tokens (prompt
    excluded), tokens per round, timings in seconds."""

    tokens: list[int]
    acceptance_lengths: list[int]
    prefill_seconds: float
    decode_seconds: float
    # part of prefill_seconds + decode_seconds spent compiling (first call per shape)
    compile_seconds: float = 0.0
    # The round's shape with defaults filled in: {"block":
    # B} for DFlash, plus "budget" for DDTree, {} for AR.
    round_shape: dict[str, int] = dataclasses.field(default_factory=dict)
    # The batch's rounds of each spec by name (``ddtree-7``, ``ar``; several with budget "auto").
    spec_rounds: dict[str, int] = dataclasses.field(default_factory=dict)
    # With ``trace_topk`` > 0: per round, the drafter's top-k tokens
    # [block - 1, k], and for DDTree the tree (tokens, parents) of its
    # valid nodes, root first (for cross-checking against a reference).
    draft_topk: list[np.ndarray] = dataclasses.field(default_factory=list)
    trees: list[tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=list)
    # With ``logprobs`` > 0: per new token, and with ``score_prompt`` per prompt token after the
    # first, its logprob and top ones under the target (before temperature and cut-offs).
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)

    @property
    def rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def mean_acceptance(self) -> float:
        return float(np.mean(self.acceptance_lengths)) if self.acceptance_lengths else 0.0


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    """How ``generate_batch`` decodes a batch (see there);
    the checks that need no model run once, when made."""

    sampling: Sampling | list[Sampling] = GREEDY  # one for all prompts, or one each
    method: Method = "dflash"
    max_new_tokens: int | list[int] = 64  # one for all prompts, or one each
    stop_token_ids: list[int] | None = None  # default: the target's EOS ids
    block_size: int | None = None  # default: the drafter's
    # DDTree nodes per round, default block_size - 1; "auto": each round chosen (``round_set``)
    budget: int | Literal["auto"] | None = None
    max_children: int | None = None
    trace_topk: int = 0
    tree_logits: TreeLogits = "scaled"
    logprobs: int = 0  # > 0: each new token's logprob and this many top ones
    score_prompt: bool = False  # with logprobs: the prompt's too
    prefill_chunk: int | None = None  # a longer prompt prefilled this many tokens a call

    def __post_init__(self):
        check_tree_logits(self.tree_logits)
        asked = self.max_new_tokens
        lengths = asked if isinstance(asked, list | tuple) else [asked]
        if any(not isinstance(m, int) or m < 1 for m in lengths):
            raise InputError.at(
                "max_new_tokens", f"must be >= 1 (an integer, or one per prompt), got {asked}"
            )
        chunk = self.prefill_chunk
        if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
            raise InputError.at("prefill_chunk", f"must be an integer >= 1, got {chunk!r}")
        for name in ("trace_topk", "logprobs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise InputError.at(name, f"must be an integer >= 0, got {value!r}")
        if self.score_prompt and not self.logprobs:
            raise InputError.at("score_prompt", "needs logprobs > 0")
        if isinstance(self.budget, str) and self.budget != "auto":
            raise InputError.at("budget", f"expected an integer or 'auto', got {self.budget!r}")

    @classmethod
    def of(cls, options: GenerateOptions | None, fields: dict) -> GenerateOptions:
        """``options``, or the options made of keyword ``fields`` (not both)."""
        if options is None:
            return cls(**fields)
        if fields:
            raise InputError.at(
                "options", f"give a GenerateOptions or keywords, not both (got {sorted(fields)})"
            )
        return options


@dataclasses.dataclass(frozen=True)
class RoundBatch:
    """A batch's fixed settings: the round every step runs and the per-row arrays it reads."""

    spec: RoundSpec
    settings: RowSettings  # on the device once, not copied there again by every round


class SpeculativeDecoder:
    """Generation with a target and, for ``dflash`` / ``ddtree``, a
    drafter, greedy or sampled per request; compiled once per shape bucket.

    ``attention`` picks the verify attention: ``absorbed`` (XLA; over pools of pages on one CPU
    device the C++ tree-attention kernel), ``pallas`` (the Pallas kernel, interpreted on CPU), or
    ``auto``: as the backend of the target's devices prefers (``jaxdd.runtime.backend``).
    ``cache_layout``: the latent cache ``replicated`` on every device of the target's mesh or
    ``striped`` over them (``jaxdd.cache.stripes``; one device holds it whole either way).
    ``drafter_kv``: the drafter's context K/V in the models' dtype or in ``fp8`` (half the
    bytes; only the drafts change: greedy tokens stay the target's, sampled ones its
    distribution, not a seed's draws).
    """

    def __init__(
        self,
        target: LoadedTarget,
        drafter: DFlashDrafter | None = None,
        attention: AttentionChoice = "auto",
        backend: Backend | None = None,
        cache_layout: CacheLayout = "replicated",
        drafter_kv: DrafterKV = "model",
    ):
        if cache_layout not in LAYOUTS:
            raise InputError.at(
                "cache_layout", f"expected one of {', '.join(LAYOUTS)}, got {cache_layout!r}"
            )
        if drafter_kv not in DRAFTER_KVS:
            raise InputError.at(
                "drafter_kv", f"expected one of {', '.join(DRAFTER_KVS)}, got {drafter_kv!r}"
            )
        if attention not in ATTENTION_CHOICES:
            raise InputError.at(
                "attention", f"expected 'auto', 'absorbed' or 'pallas', got {attention!r}"
            )
        self.target = target
        self.config = target.model.config
        self.drafter = drafter
        self.backend = backend or Backend.of_module(target.model)
        self.backend.prepare_host()
        self.attention = self.backend.attention(attention)
        if drafter_kv == "fp8" and self.attention == "pallas" and not self.backend.fp8_kernels:
            raise InputError.at(
                "drafter_kv",
                "fp8 K/V in the tree-attention kernel needs GPUs of compute capability 8.9 or "
                "newer (Ada, Hopper, Blackwell); use attention='absorbed' or the models' dtype",
            )
        # set when the models were placed with jaxdd.runtime.sharding.shard_module
        self.mesh = mesh_of(target.model)
        self.drafter_kv = drafter_kv
        self.stripes = None
        if cache_layout == "striped" and self.mesh is not None:
            self.stripes = Stripes(self.mesh)
        self._round_sizes = RoundSizes()
        # by pool shape, the jit making its empty state (a chunked generate makes a pool a call)
        self._state_makers: dict[RowShape, Callable[[], DecodeState]] = {}
        target_structure, target_weights = split_module(target.model)
        self._target_only = ModelPair(
            target_weights, None, target_structure=target_structure, drafter_structure=None
        )
        self._models = self._target_only
        if drafter is not None:
            drafter.config.check_fits(self.config)
            drafter_structure, drafter_weights = split_module(drafter)
            self._models = ModelPair(
                target_weights,
                drafter_weights,
                target_structure=target_structure,
                drafter_structure=drafter_structure,
            )

    def generate(self, prompt_ids, *, sampling: Sampling = GREEDY, **options) -> Generation:
        """Decode up to ``max_new_tokens`` after one
        prompt; see ``generate_batch`` for the options."""
        prompt = np.asarray(prompt_ids)
        if prompt.ndim not in (1, 2):
            raise InputError.at("prompt_ids", f"expected token ids, got shape {prompt.shape}")
        prompts = list(prompt) if prompt.ndim == 2 else [prompt]  # checked in generate_batch
        if len(prompts) != 1:
            raise InputError.at(
                "prompt_ids", f"one prompt at a time, got batch {len(prompts)}; use generate_batch"
            )
        return self.generate_batch(prompts, sampling=sampling, **options)[0]

    def generate_batch(
        self,
        prompts: list[list[int]],
        *,
        on_tokens: Callable[[int, list[int]], None] | None = None,
        options: GenerateOptions | None = None,
        **fields,
    ) -> list[Generation]:
        """Decode a batch of requests together, each
        with its own length, sampling settings and seed.

        Greedy and sampled requests mix freely; a request that stops early stops changing while the
        others go on. The batch is padded to a power of two (and prompts and the cache to their
        buckets), so shapes repeat. Options: ``sampling`` (one ``Sampling`` or one per prompt;
        default greedy), ``method`` ("ar", "dflash", "ddtree"), ``max_new_tokens`` (one or one per
        prompt), ``stop_token_ids`` (default: the target's EOS ids), ``block_size``, ``budget``
        (DDTree nodes per round, default block_size - 1; "auto": each round the one of a set
        expected to give the most tokens per second, ``jaxdd.decoding.round_set``; the results'
        ``spec_rounds`` count each), ``max_children`` (caps the branching; 1
        verifies the DFlash chain through the tree path), ``tree_logits`` (sampled DDTree: build
        the tree from the draft logits at the request's temperature, "scaled", or from the raw
        logits, "raw"; lossless either way). ``trace_topk`` > 0 records each round's draft top-k
        (and DDTree trees) in the results. ``logprobs`` > 0 records each new token's logprob and
        top ``logprobs`` under the target's distribution before temperature and cut-offs (the
        tokens are the same), ``score_prompt`` each prompt token's after the first too.
        ``prefill_chunk``: a prompt longer than that is prefilled that many tokens per call (the
        activations of one chunk, not the prompt's; the same tokens), unless it is scored (whole:
        every position's logits at once). ``on_tokens(request, new_tokens)`` is called as tokens
        are accepted (the first one after the prefill, then each round's), e.g. to stream text.
        The options may come as one ``GenerateOptions`` (``options``) or as its fields by keyword.
        """
        emit = on_tokens or (lambda request, tokens: None)
        with compile_clock() as clock:
            t0 = time.perf_counter()
            pool = self.admitted(prompts, options, **fields)
            driver = Driver(pool, arrivals=False)
            first = driver.first_tokens()
            prefill_seconds = time.perf_counter() - t0
            results = [Generation([], [], prefill_seconds, 0.0) for _ in prompts]
            for update in first.values():
                _take(results, update, emit)
            t0 = time.perf_counter()
            while driver.running:
                for update in driver.step().values():
                    _take(results, update, emit)
            decode_seconds = time.perf_counter() - t0
        spec, chosen = pool.shape.spec, dict(pool.chooser.rounds)
        round_shape = {} if spec.method == "ar" else {"block": spec.block}
        if spec.method == "ddtree":
            round_shape["budget"] = spec.budget
        for result in results:
            result.decode_seconds = decode_seconds
            result.compile_seconds = clock.seconds
            result.round_shape = dict(round_shape)
            result.spec_rounds = dict(chosen)
        return results

    def lower_round(self, batch: RoundBatch, state: DecodeState) -> jax.stages.Lowered:
        """The round of ``batch``, lowered for ``state``
        (arrays or ShapeDtypeStructs): for compiling ahead of time
        (``jaxdd.plan``), reading the HLO, or profiling its stages."""
        round_ = programs_for(state, self.mesh).decode_round
        return round_.lower(batch.spec, self.models_for(batch.spec), state, batch.settings)

    def round_spec(
        self,
        method: Method,
        block: int = 1,
        budget: int | None = None,
        max_children: int | None = None,
        sampled: bool = False,
        trace: int = 0,
        tree_logits: TreeLogits = "scaled",
        top_logprobs: int = 0,
    ) -> RoundSpec:
        """The static description of a round on this decoder's backend and attention."""
        return RoundSpec(
            method=method,
            backend=self.backend,
            block=block,
            budget=budget,
            max_children=max_children,
            attention=self.attention,
            sampled=sampled,
            trace=trace,
            tree_logits=tree_logits,
            top_logprobs=top_logprobs,
            stripes=self.stripes,
            drafter_kv=self.drafter_kv,
        )

    def admitted(
        self, prompts: list[list[int]], options: GenerateOptions | None = None, **fields
    ) -> RowPool:
        """A pool of rows for the batch (checked, its round sized), every request admitted (its
        prefill dispatched): what ``generate_batch`` steps (options as there)."""
        options = GenerateOptions.of(options, fields)
        requests, shape = self._batch_shape(prompts, options)
        pool = RowPool(self, shape, auto=options.budget == "auto")
        if options.budget == "auto":
            pool.time_rounds()  # the set compiled now: its rounds are timed, not compiled, later
        pool.admit(requests, owners=list(range(len(requests))))
        batch = RoundBatch(shape.spec, pool.settings.device())
        trained = None if self.drafter is None else self.drafter.config.block_size
        lower = lambda: self.lower_round(batch, pool.state)
        self._round_sizes.check(lower, batch.spec, pool.state, batch.settings, trained)
        return pool

    def _batch_shape(
        self, prompts: list[list[int]], options: GenerateOptions
    ) -> tuple[list[RowRequest], RowShape]:
        """The batch's requests, each checked (``check_request``), and the shape of rows that runs
        them (``pool_shape``): one round, rows padded to a power of two, prompts and the cache to
        their buckets, lengths those the requests reach within the model's positions."""
        if not prompts:
            raise InputError.at("prompts", "the batch is empty")
        n = len(prompts)
        samplings = per_request("sampling and max_new_tokens", options.sampling, n)
        lengths = per_request("sampling and max_new_tokens", options.max_new_tokens, n)
        stops = options.stop_token_ids
        stops = list(self.config.eos_token_ids if stops is None else stops)
        asked = options.logprobs or None
        requests = [
            RowRequest(list(p), m, stops, s, asked, options.score_prompt)
            for p, m, s in zip(prompts, lengths, samplings, strict=True)
        ]
        # sizes every request fits, within the model's positions: one past them is refused below
        reach = max(len(r.prompt) + r.max_new_tokens for r in requests)
        max_len = max(min(reach, self.config.max_position_embeddings), 2)
        longest = max(min(max(len(r.prompt) for r in requests), max_len - 1), 1)
        chunk = options.prefill_chunk
        pool = PoolOptions(
            options.method,
            rows=bucket(n, minimum=1),
            max_len=max_len,
            max_prompt=longest,
            block_size=options.block_size,
            budget=None if options.budget == "auto" else options.budget,  # auto: the set's largest
            max_children=options.max_children,
            max_logprobs=options.logprobs,
            prefill_chunk=None if chunk is None else min(chunk, longest),  # longer: whole
            trace=options.trace_topk,
            tree_logits=options.tree_logits,
            batch_sampled=any(not s.greedy for s in samplings),
        )
        shape = pool_shape(self, pool)
        return [check_request(r, shape, self.config, API_WORDS) for r in requests], shape

    def models_for(self, spec: RoundSpec) -> ModelPair:
        """The weights a round of ``spec`` reads: the target's alone for AR."""
        return self._target_only if spec.method == "ar" else self._models

    def empty_state(self, shape: RowShape) -> DecodeState:
        """A new state of ``shape``, every row done (``RowShape.state_maker``, once per shape)."""
        if shape not in self._state_makers:
            self._state_makers[shape] = shape.state_maker(self)
        return self._state_makers[shape]()


def _take(results: list[Generation], update: RowUpdate, emit: Callable) -> None:
    """``update``'s tokens, their logprobs and its round's trace into its request's result (the
    owner its index), the tokens streamed; a round's are an acceptance length, the prefill's
    first token none."""
    result = results[update.owner]
    if update.tokens:
        result.tokens.extend(update.tokens)
        emit(update.owner, update.tokens)
    if len(update.tokens) > update.first:
        result.acceptance_lengths.append(len(update.tokens) - update.first)
    if update.first:
        result.prompt_logprobs = update.prompt_logprobs or []
    if update.logprobs is not None:
        result.logprobs.extend(update.logprobs)
    if update.trace is not None:
        _record_trace(result, update.trace)


def _record_trace(result: Generation, trace: RoundTrace) -> None:
    result.draft_topk.append(trace.draft_topk)
    if trace.tree is not None:
        result.trees.append(trace.tree)
