"""The device side of decoding: one jitted, static-shape round per method, on the decode
state of ``jaxdd.decoding.state``, donated so every cache is updated in place.

A round, for a committed prefix of length ``start`` and the bonus token at position ``start``:

1. draft:  the drafter caches the K/V of the context features committed
           last round, then denoises ``[bonus, MASK x (B-1)]`` in one
           forward: draft logits for positions start+1 .. start+B-1;
2. build:  DFlash takes one token per position (a chain); DDTree builds a
           best-first tree of ``budget`` nodes (``jaxdd.decoding.tree``);
3. verify: one target forward over the chain or the tree (each node sees the prefix and its
           ancestors, at position start + depth), which also returns the tapped hidden layers;
4. accept: the target's choice per node (argmax, or a sample), walked from the
           root while it matches a child; the first miss is the next bonus;
5. commit: the accepted path's latent rows move to contiguous slots (a chain's already are),
           ``length`` moves, and the path's taps become the next round's drafter context.

AR is the round with no draft. Near ``max_length`` the block shrinks to ``max_length -
start`` tokens (the drafter hides the rest, acceptance stops there) and a round stops
at the first stop token, as z-lab ``dflash.model.dflash_generate`` does. Each stage is
a ``jax.named_scope``, so profiles and the compiled HLO attribute time to it. The host
reads back one small array per round: the emitted tokens (``RoundReport``).

With ``RoundSpec.top_logprobs`` = k > 0 a round also reports each emitted token's log-probability
and its position's top-k under the verify's target distribution BEFORE temperature and cut-offs
(vLLM's default): a log-softmax and a top-k of the emitted positions' logits, choosing no token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxdd.cache import LatentCache
from jaxdd.cache.layout import front, put_front
from jaxdd.decoding.report import RoundReport
from jaxdd.decoding.sampling import (
    SamplingArrays,
    argmax,
    filtered_probs,
    sample,
    split_keys,
)
from jaxdd.decoding.scores import Scores, token_logprobs
from jaxdd.decoding.state import DecodeState, ModelPair, RoundSpec, RowSettings
from jaxdd.decoding.tree import accept_path, build_tree
from jaxdd.models.drafter import DFlashDrafter
from jaxdd.models.target import KimiTarget


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def decode_round(
    spec: RoundSpec, models: ModelPair, state: DecodeState, settings: RowSettings
) -> tuple[DecodeState, jax.Array]:
    """One round of ``spec.method`` for the whole batch: (new state, the
    round's report, ``RoundReport.encode``: with ``trace`` the drafter's top-k
    per draft position and for DDTree the tree's tokens and parents)."""
    target, drafter = models.merge()
    state = state.with_pages(settings.pages)
    if spec.method == "ar":
        return _ar_step(spec, target, drafter, state, settings)
    return (_dflash_round if spec.method == "dflash" else _ddtree_round)(
        spec, target, drafter, state, settings
    )


@functools.partial(jax.jit, static_argnames=("spec", "rows"), donate_argnames=("state",))
def front_round(
    spec: RoundSpec, models: ModelPair, state: DecodeState, settings: RowSettings, rows: int
) -> tuple[DecodeState, jax.Array]:
    """``decode_round`` on the first ``rows`` rows only (the rest unchanged): while
    few rows are busy, a round costs what their number does, not the pool's."""
    new, report = decode_round(spec, models, *front((state, settings), rows))
    return put_front(state, new), report


def _ar_step(
    spec: RoundSpec,
    target: KimiTarget,
    drafter: DFlashDrafter | None,
    state: DecodeState,
    settings: RowSettings,
):
    """A plain round; in a state with a drafter (a pool that also speculates) it keeps the new
    token's taps after the drafter context still pending (``_pend``), so a speculative round
    after it drafts from the whole context."""
    draft_cache, context, pending = None, None, None
    taps = () if state.draft_cache is None else drafter.config.target_layer_ids
    with jax.named_scope("verify"):
        logits, features, cache = _verify_chain(
            spec, target, state.target_cache, state.bonus[:, None], taps
        )
    with jax.named_scope("accept"):
        token, rng = choose(spec, logits[:, 0], settings.sampling, state.rng)
    with jax.named_scope("commit"):
        if taps:
            with jax.named_scope("draft"):
                draft_cache, context, pending = _pend(drafter, state, settings, features)
        scores = round_scores(spec, logits, token[:, None])
        accepted = jnp.zeros_like(token)
        return _commit(
            state,
            token[:, None],
            accepted,
            cache,
            context,
            draft_cache,
            rng,
            settings,
            scores,
            pending=pending,
        )


def _pend(drafter: DFlashDrafter, state: DecodeState, settings: RowSettings, features):
    """A plain round's drafter context: (drafter cache, context, rows pending before the new
    token's taps, which follow them). The pending rows are cached only once some running row's
    fill the context (then every row's: one drafter pass per block of plain rounds, not one
    each; the speculative round after them caches what is left)."""
    width, new = state.context.shape[1], features.astype(state.context.dtype)
    full = (state.context_count >= width) & ~state.done & ~settings.paused

    def cached(_):
        fresh = jnp.pad(new, ((0, 0), (0, width - 1), (0, 0)))
        return _cache_context(drafter, state), fresh, jnp.zeros_like(state.context_count)

    def appended(_):
        at = jnp.minimum(state.context_count, width - 1)[:, None, None]
        context = jnp.where(jnp.arange(width)[None, :, None] == at, new, state.context)
        return state.draft_cache, context, state.context_count

    return jax.lax.cond(full.any(), cached, appended, None)


def _dflash_round(
    spec: RoundSpec, target: KimiTarget, drafter: DFlashDrafter, state: DecodeState, settings
):
    """With ``spec.sampled``, drafts are sampled and accepted by
    ``dflash_generate``'s rejection sampling (``accept_sampled``; greedy rows'
    one-hot distributions make it the greedy rule); otherwise the argmax chain."""
    block_len = jnp.clip(settings.max_length - state.target_cache.length, 1, spec.block)
    with jax.named_scope("draft"):
        logits, draft_cache = _draft(spec, drafter, target, state, block_len)
    rng = state.rng
    with jax.named_scope("build"):
        if spec.sampled:
            rng, (draft_key, *accept_keys) = split_keys(rng, 3)
            draft_probs = filtered_probs(logits, settings.sampling, spec.backend.cut_off_ways())
            drafts = sample(draft_key, draft_probs)
        else:
            drafts = argmax(logits)
        tokens = jnp.concatenate([state.bonus[:, None], drafts], axis=1)
    with jax.named_scope("verify"):
        taps = drafter.config.target_layer_ids
        target_logits, features, cache = _verify_chain(
            spec, target, state.target_cache, tokens, taps
        )
    with jax.named_scope("accept"):
        if spec.sampled:
            target_probs = filtered_probs(
                target_logits, settings.sampling, spec.backend.cut_off_ways()
            )
            emitted, accepted = accept_sampled(
                drafts, draft_probs, target_probs, block_len, accept_keys
            )
        else:
            emitted, accepted = accept_greedy(drafts, argmax(target_logits), block_len)
    with jax.named_scope("commit"):
        trace = {"draft_topk": jax.lax.top_k(logits, spec.trace)[1]} if spec.trace else {}
        # emitted token i was chosen at chain position i
        scores = round_scores(spec, target_logits, emitted)
        return _commit(
            state, emitted, accepted, cache, features, draft_cache, rng, settings, scores, **trace
        )


def _ddtree_round(
    spec: RoundSpec, target: KimiTarget, drafter: DFlashDrafter, state: DecodeState, settings
):
    """Sampled rows use the target-only rule: one token is sampled from the target's filtered
    distribution at every node; the walk descends while the sample is a child's token and the
    first sample that is not becomes the bonus, so every emitted token is a draw from the
    target (lossless for any tree). The tree is built from the drafter's logits at the
    request's temperature (``tree_logits="scaled"``) or from the raw logits."""
    start = state.target_cache.length
    block_len = jnp.clip(settings.max_length - start, 1, spec.block)
    with jax.named_scope("draft"):
        logits, draft_cache = _draft(spec, drafter, target, state, block_len)
    with jax.named_scope("build"):
        tree_logits = logits
        if spec.sampled and spec.tree_logits == "scaled":
            temperature = settings.sampling.temperature[:, None, None]
            tree_logits = logits / jnp.where(temperature > 0, temperature, 1.0)
        tree = build_tree(tree_logits, state.bonus, block_len - 1, spec.budget, spec.max_children)
    with jax.named_scope("verify"):
        taps = drafter.config.target_layer_ids
        positions = start[:, None] + tree.depths
        out = target(
            tree.tokens,
            positions,
            state.target_cache,
            tree.visible,
            taps=taps,
            **_forward_options(spec),
        )
        target_logits = target.logits(out.hidden, spec.backend)
    with jax.named_scope("accept"):
        choice, rng = choose(spec, target_logits, settings.sampling, state.rng)
        path, accepted = accept_path(tree, choice, spec.block - 1)
        # the target's choices along the path: drafts + bonus
        emitted = jnp.take_along_axis(choice, path, axis=1)
    with jax.named_scope("commit"):
        cache = out.cache.keep_path(path)
        context = jnp.take_along_axis(out.taps, path[:, :, None], axis=1)  # features in path order
        trace = {}
        if spec.trace:
            unused = ~tree.valid
            tree_tokens = jnp.where(unused, -1, tree.tokens)
            tree_parents = jnp.where(unused, -1, tree.parents)
            trace = {
                "draft_topk": jax.lax.top_k(logits, spec.trace)[1],
                "tree": (tree_tokens, tree_parents),
            }
        scores = None
        if spec.top_logprobs:  # the path's nodes only: the rest of the tree emits nothing
            path_logits = jnp.take_along_axis(target_logits, path[:, :, None], axis=1)
            scores = round_scores(spec, path_logits, emitted)
        return _commit(
            state, emitted, accepted, cache, context, draft_cache, rng, settings, scores, **trace
        )


def round_scores(spec: RoundSpec, logits: jax.Array, tokens: jax.Array) -> Scores | None:
    """With ``spec.top_logprobs``, ``token_logprobs`` of ``tokens`` chosen at ``logits``'s
    positions; None without."""
    return token_logprobs(logits, tokens, spec.top_logprobs) if spec.top_logprobs else None


def _forward_options(spec: RoundSpec) -> dict:
    return {"attention": spec.attention, "backend": spec.backend}


def _draft(
    spec: RoundSpec,
    drafter: DFlashDrafter,
    target: KimiTarget,
    state: DecodeState,
    block_len: jax.Array,
):
    """Cache the drafter K/V of the tokens committed last round (the last ``context_count``
    positions), then draft: (logits [B, block - 1, V], drafter cache). Where the verify's attention
    runs in a kernel (``Backend.attention_kernel``) the drafter's does too."""
    start = state.target_cache.length
    draft_cache = _cache_context(drafter, state)
    kernel = spec.backend.attention_kernel(spec.attention, draft_cache.pages is not None)
    return drafter.draft_logits(
        target, draft_cache, state.bonus, start, block_len, spec.block, kernel
    )


def _cache_context(drafter: DFlashDrafter, state: DecodeState):
    """The drafter cache with the K/V of the tokens committed last round (the last
    ``context_count`` positions) cached."""
    columns = jnp.arange(state.context.shape[1])[None, :]
    positions = (state.target_cache.length - state.context_count)[:, None] + columns
    return drafter.inject(state.draft_cache, state.context, positions, state.context_count)


def _verify_chain(
    spec: RoundSpec,
    target: KimiTarget,
    cache: LatentCache,
    tokens: jax.Array,
    taps: tuple[int, ...],
):
    """Causal target forward over a chain of tokens:
    (fp32 logits per position, the taps, the cache)."""
    b, t = tokens.shape
    positions = cache.length[:, None] + jnp.arange(t)[None, :]
    visible = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    out = target(tokens, positions, cache, visible, taps=taps, **_forward_options(spec))
    return target.logits(out.hidden, spec.backend), out.taps, out.cache


def choose(spec: RoundSpec, logits: jax.Array, sampling: SamplingArrays, rng: jax.Array):
    """The target's token per position (argmax, or a sample from
    the filtered distribution) and the advanced random streams."""
    if not spec.sampled:
        return argmax(logits), rng
    rng, (key,) = split_keys(rng, 1)
    return sample(key, filtered_probs(logits, sampling, spec.backend.cut_off_ways())), rng


def accept_greedy(drafts, posterior, block_len):
    """Chain, greedy: (emitted [B, block], accepted [B]). Accepted
    drafts equal the target's choices, so the emitted tokens are
    simply the target's argmax row, the last one being the bonus."""
    steps = jnp.arange(drafts.shape[1])[None, :]
    matches = (drafts == posterior[:, :-1]) & (steps < block_len[:, None] - 1)
    return posterior, jnp.cumprod(matches, axis=1).sum(axis=1)


def accept_sampled(drafts, draft_probs, target_probs, block_len, keys):
    """Chain, sampled, as ``dflash_generate``'s ``_rejection_sample``: draft i survives with
    probability min(1, p/q); the token after the last survivor comes from the residual max(p - q, 0)
    (renormalized), or from the target itself when every draft survived. Greedy rows have one-hot p
    and q, which makes this the greedy rule. Returns (emitted [B, block], accepted [B])."""
    accept_key, bonus_key = keys
    gamma = block_len - 1
    steps = jnp.arange(drafts.shape[1])[None, :]
    p = jnp.take_along_axis(target_probs[:, :-1], drafts[..., None], axis=-1)[..., 0]
    q = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
    u = jax.vmap(lambda k: jax.random.uniform(k, drafts.shape[1:]))(accept_key)
    survives = (u * q < p) & (steps < gamma[:, None])
    accepted = jnp.cumprod(survives, axis=1).sum(axis=1)
    target_row = jnp.take_along_axis(target_probs, accepted[:, None, None], axis=1)[:, 0]
    draft_row = jnp.take_along_axis(
        draft_probs, jnp.minimum(accepted, drafts.shape[1] - 1)[:, None, None], axis=1
    )
    residual = jnp.maximum(target_row - draft_row[:, 0], 0.0)
    total = residual.sum(-1, keepdims=True)
    use_residual = (accepted < gamma)[:, None] & (total > 0)
    bonus = sample(
        bonus_key, jnp.where(use_residual, residual / jnp.where(total > 0, total, 1.0), target_row)
    )
    full_steps = jnp.arange(drafts.shape[1] + 1)[None, :]
    drafts_padded = jnp.concatenate([drafts, drafts[:, :1]], axis=1)
    return jnp.where(full_steps < accepted[:, None], drafts_padded, bonus[:, None]), accepted


def limit_round(emitted, accepted, max_length, start, stop_ids, done):
    """(produced [B], stopped [B], done [B]): accepted + 1 tokens, cut at the request's
    max length and after its first stop token; rows already done produce nothing."""
    produced = jnp.minimum(accepted + 1, max_length - start - 1)
    is_stop = (emitted[:, :, None] == stop_ids[:, None, :]).any(-1)
    is_stop &= jnp.arange(emitted.shape[1])[None, :] < produced[:, None]
    stopped = is_stop.any(axis=1) & ~done
    produced = jnp.where(stopped, jnp.argmax(is_stop, axis=1) + 1, produced)
    produced = jnp.where(done, 0, produced).astype(jnp.int32)
    return produced, stopped, done | stopped | (start + produced + 1 >= max_length)


def _commit(
    state: DecodeState,
    emitted,
    accepted,
    cache,
    context,
    draft_cache,
    rng,
    settings: RowSettings,
    scores: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    draft_topk: jax.Array | None = None,
    tree: tuple[jax.Array, jax.Array] | None = None,
    pending: jax.Array | None = None,
):
    """Keep ``produced`` tokens per row (rows already done or paused keep everything as
    it was) and report (with ``scores``, the emitted tokens' logprobs); the context's rows are
    ``pending`` ones (a plain round's, not yet cached) and the produced tokens'."""
    start, paused = state.target_cache.length, settings.paused
    produced, stopped, done = limit_round(
        emitted, accepted, settings.max_length, start, settings.stop_ids, state.done | paused
    )
    last = jnp.take_along_axis(emitted, jnp.maximum(produced - 1, 0)[:, None], axis=1)[:, 0]
    count = None
    if context is not None:  # a paused row's context is cached again by the round it runs in
        count = produced if pending is None else pending + produced
        count = jnp.where(paused, state.context_count, count)
        context = jnp.where(paused[:, None, None], state.context, context)
        kept = jnp.where(paused, state.draft_cache.length, draft_cache.length)
        draft_cache = draft_cache.replace(length=kept)
    new_state = DecodeState(
        target_cache=cache.commit(produced),
        bonus=jnp.where(produced > 0, last, state.bonus),
        done=jnp.where(paused, state.done, done),
        rng=jnp.where(paused[:, None], state.rng, rng),
        draft_cache=draft_cache,
        context=context,
        context_count=count,
    )
    return new_state, RoundReport.encode(emitted, produced, stopped, draft_topk, tree, scores)
