"""The prefill: the prompts run through the target into rows of a decode state, their first
tokens chosen and the drafter's context cached; alone into one row of a running state
(``prefill_row``, a request admitted between rounds), into all rows of an empty one, or after
the cached pages a request starts with (``prefill_after``: the rest of its prompt only)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxdd.cache import LatentCache, Paging
from jaxdd.cache.layout import clear_rows, put_rows, take_rows
from jaxdd.decoding.report import RoundReport
from jaxdd.decoding.rounds import choose, round_scores
from jaxdd.decoding.sampling import seed_keys
from jaxdd.decoding.scores import token_logprobs
from jaxdd.decoding.state import DecodeState, ModelPair, RoundSpec, RowSettings, state_shardings
from jaxdd.models.drafter import DFlashDrafter
from jaxdd.models.target import KimiTarget, TargetOutput


@functools.partial(jax.jit, static_argnames=("spec", "mesh", "score"), donate_argnames=("state",))
def prefill(
    spec: RoundSpec,
    models: ModelPair,
    state: DecodeState,
    tokens: jax.Array,
    prompt_len: jax.Array,
    settings: RowSettings,
    seeds: jax.Array,
    mesh: jax.sharding.Mesh | None,
    score: bool = False,
) -> tuple[DecodeState, jax.Array]:
    """Run the (padded) prompts into the rows of ``state`` (the rows they take, each holding the
    pages of its table in ``settings``; whatever they held before is dropped), commit
    ``prompt_len`` tokens per row, choose each row's first token, and cache the drafter context:
    (the state for rounds of ``spec``, placed on ``mesh`` if given; a report as a round's, the
    first token produced). A row is done at once if that token is a stop token or its length
    allows no more. With ``spec.top_logprobs`` the report has the first token's logprobs; with
    ``score`` too those of prompt positions 1 .. padded length - 1 (from the target's logits at
    every position, which only a scored prefill computes)."""
    target, drafter = models.merge()
    b, t = tokens.shape
    state = _fresh(state, settings, seeds)
    positions = jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))
    # The cache is empty: the prompt attends over a cache of its own length, whose rows then
    # fill the state's, instead of over every slot (less attention by the slots' padding).
    prompt_cache = LatentCache.zeros(target.config, b, t, target.dtype)
    out = target(
        tokens,
        positions,
        prompt_cache,
        _causal(b, t),
        taps=_taps(drafter),
        attention="naive",
        backend=spec.backend,
    )
    cache = state.target_cache.fill(out.cache, prompt_len)
    scored = tokens if score else None
    return _first_token(
        spec, target, drafter, state, out, cache, positions, prompt_len, settings, mesh, scored
    )


def _fresh(state: DecodeState, settings: RowSettings, seeds: jax.Array) -> DecodeState:
    """``state``'s rows emptied for new requests: their seeds' streams, their page tables."""
    return clear_rows(state).replace(rng=seed_keys(seeds)).with_pages(settings.pages)


def _causal(b: int, t: int) -> jax.Array:
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))


def _taps(drafter: DFlashDrafter | None) -> tuple[int, ...]:
    return () if drafter is None else drafter.config.target_layer_ids


def _first_token(
    spec: RoundSpec,
    target: KimiTarget,
    drafter: DFlashDrafter | None,
    state: DecodeState,
    out: TargetOutput,
    cache: LatentCache,
    positions: jax.Array,
    count: jax.Array,
    settings: RowSettings,
    mesh: jax.sharding.Mesh | None,
    scored: jax.Array | None = None,
) -> tuple[DecodeState, jax.Array]:
    """After a forward ``out`` over ``count`` [b] new prompt tokens at ``positions``, whose rows
    ``cache`` holds: each row's first token chosen, the drafter's context cached, the report
    (with ``scored``, the prompt tokens, their logprobs too)."""
    b = count.shape[0]
    last = jnp.take_along_axis(out.hidden, (count - 1)[:, None, None], axis=1)
    last_logits = target.logits(last, spec.backend)
    first, rng = choose(spec, last_logits[:, 0], settings.sampling, state.rng)
    stopped = (first[:, None] == settings.stop_ids).any(-1)
    done = stopped | (cache.length + 1 >= settings.max_length)
    state = state.replace(target_cache=cache, bonus=first, rng=rng, done=done)
    if drafter is not None:
        state = state.replace(
            draft_cache=drafter.inject(state.draft_cache, out.taps, positions, count)
        )
    if mesh is not None:
        state = jax.lax.with_sharding_constraint(state, state_shardings(state, mesh))
    emitted = jnp.zeros((b, spec.width), jnp.int32).at[:, 0].set(first)
    scores = None
    prompt_scores = None
    if spec.top_logprobs:
        # the report's logprob columns are a round's: the first token's, then unused positions
        first_scores = round_scores(spec, last_logits, first[:, None])
        unused = spec.width - 1
        scores = tuple(
            jnp.pad(x, [(0, 0), (0, unused)] + [(0, 0)] * (x.ndim - 2)) for x in first_scores
        )
    if scored is not None:
        # position i's logits choose token i + 1
        all_logits = target.logits(out.hidden[:, :-1], spec.backend)
        prompt_scores = token_logprobs(all_logits, scored[:, 1:], spec.top_logprobs)
    report = RoundReport.encode(
        emitted, jnp.ones((b,), jnp.int32), stopped, logprobs=scores, prompt_logprobs=prompt_scores
    )
    return state, report


@functools.partial(jax.jit, static_argnames=("spec", "mesh", "score"), donate_argnames=("state",))
def prefill_row(
    spec: RoundSpec,
    models: ModelPair,
    state: DecodeState,
    row: jax.Array,
    tokens: jax.Array,
    prompt_len: jax.Array,
    settings: RowSettings,
    seeds: jax.Array,
    mesh: jax.sharding.Mesh | None,
    score: bool = False,
) -> tuple[DecodeState, jax.Array]:
    """``prefill`` one request (``score``: and its prompt's logprobs) into row ``row`` of
    ``state`` (in place: the state is donated): (state, the prefill's report)."""
    rows = row[None]
    part = take_rows(state, rows)
    new, report = prefill(spec, models, part, tokens, prompt_len, settings, seeds, mesh, score)
    return put_rows(state, new, rows), report


@functools.partial(jax.jit, static_argnames=("spec", "mesh"), donate_argnames=("state",))
def prefill_after(
    spec: RoundSpec,
    models: ModelPair,
    state: DecodeState,
    row: jax.Array,
    tokens: jax.Array,
    count: jax.Array,
    settings: RowSettings,
    seeds: jax.Array,
    mesh: jax.sharding.Mesh | None,
    start: jax.Array,
    last: jax.Array,
) -> tuple[DecodeState, jax.Array]:
    """``prefill_row`` for a request whose pages hold its first ``start`` tokens already (both
    caches: a prefix cache hit, or the chunks before): only ``tokens`` [1, T], of which ``count``
    [1] are real, run, at positions ``start`` .., attending over the cached rows and each other
    as the verify of a chain does. Unless ``last`` (the prompt's end), the row stays done: the
    rounds until its last chunk leave it as it is."""
    target, drafter = models.merge()
    rows = row[None]
    part = _fresh(take_rows(state, rows), settings, seeds)
    committed = jnp.broadcast_to(start, (1,))
    part = part.replace(target_cache=part.target_cache.replace(length=committed))
    if drafter is not None:
        part = part.replace(draft_cache=part.draft_cache.replace(length=committed))
    t = tokens.shape[1]
    positions = committed[:, None] + jnp.arange(t)[None, :]
    out = target(
        tokens,
        positions,
        part.target_cache,
        _causal(1, t),
        taps=_taps(drafter),
        attention=spec.attention,
        backend=spec.backend,
    )
    cache = out.cache.commit(count)
    new, report = _first_token(
        spec, target, drafter, part, out, cache, positions, count, settings, mesh
    )
    return put_rows(state, new.replace(done=new.done | ~last), rows), report


@functools.partial(jax.jit, static_argnames=("spec", "paging", "mesh", "score"))
def prefill_new(
    spec: RoundSpec,
    models: ModelPair,
    tokens: jax.Array,
    prompt_len: jax.Array,
    settings: RowSettings,
    seeds: jax.Array,
    paging: Paging,
    mesh: jax.sharding.Mesh | None,
    score: bool = False,
) -> tuple[DecodeState, jax.Array]:
    """``prefill`` into every row of a new state paged as ``paging`` says, made inside the
    jit: made outside, its many eager dispatches cost host time on every batch."""
    target, drafter = models.merge()
    drafter_config = None if drafter is None else drafter.config
    rows = tokens.shape[0]
    sizes = (rows, paging, spec.block, target.dtype, seed_keys(seeds))
    layout = {"stripes": spec.stripes, "drafter_kv": spec.drafter_kv}
    state = DecodeState.empty(target.config, drafter_config, *sizes, **layout)
    return prefill(spec, models, state, tokens, prompt_len, settings, seeds, mesh, score)
