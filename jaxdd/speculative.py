"""Decoding rounds: plain autoregressive (``ar``), linear DFlash (``dflash``) and DDTree (``ddtree``), each one
jitted static-shape step with donated state.

One DFlash round, for a committed prefix of length ``start`` and the bonus token at position ``start``:

1. inject: the drafter caches K/V of the context features committed last round;
2. draft:  the drafter denoises ``[bonus, MASK x (B-1)]`` in one forward; B-1 greedy draft tokens;
3. verify: one causal target forward over ``[bonus, drafts]`` at positions ``start .. start+B-1``;
4. accept: the longest draft prefix equal to the target's argmax; the target's next choice is the new bonus;
5. commit: the accepted rows are already contiguous in the latent cache, so committing is moving ``length``;
   the taps of the committed tokens become the next round's context.

A DDTree round drafts the same way but keeps the draft logits, builds a best-first tree of ``budget`` nodes
(``jaxdd.tree``), verifies all of them in one forward (each node sees the prefix and its ancestors, at position
start + depth), walks the target's choices down the tree, and moves the accepted path's latent rows to
contiguous slots before committing.

Semantics follow z-lab ``dflash.model.dflash_generate``: near ``max_length`` the block shrinks to
``max_length - start`` tokens (the drafter hides the rest of the block, acceptance stops there), and a round
stops at the first stop token. The host reads back one small array per round: the emitted tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import TYPE_CHECKING, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxdd.cache import LatentCache, compact_rows
from jaxdd.drafter import DFlashDrafter, DraftCache
from jaxdd.errors import InputError
from jaxdd.jit_state import ModuleSpec, split_module
from jaxdd.sharding import cache_sharding, mesh_of
from jaxdd.target import KimiTarget, MlaForm
from jaxdd.tree import accept_path, build_tree

if TYPE_CHECKING:
    from jaxdd.api import Target

Method = Literal["ar", "dflash", "ddtree"]
MAX_STOP_TOKENS = 16  # stop ids are padded to this many so their number never changes a compiled shape
MIN_BUCKET = 16


@struct.dataclass
class DecodeState:
    target_cache: LatentCache
    bonus: jax.Array  # [B] int32: the newest token, at position target_cache.length, not in the cache yet
    draft_cache: DraftCache | None = None
    context: jax.Array | None = None  # [B, block, taps * D]: features of the tokens committed last round
    context_count: jax.Array | None = None  # [B] int32: how many rows of ``context`` are real


@dataclasses.dataclass
class Generation:
    """What ``generate`` returns: new tokens (prompt excluded), tokens per round, timings in seconds."""

    tokens: list[int]
    acceptance_lengths: list[int]
    prefill_seconds: float
    decode_seconds: float
    # With ``trace_topk`` > 0: per round, the drafter's top-k tokens [block - 1, k], and for DDTree the tree
    # (tokens, parents) of its valid nodes, root first (for cross-checking against a reference).
    draft_topk: list[np.ndarray] = dataclasses.field(default_factory=list)
    trees: list[tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=list)

    @property
    def rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def mean_acceptance(self) -> float:
        return float(np.mean(self.acceptance_lengths)) if self.acceptance_lengths else 0.0


def bucket(n: int) -> int:
    """The static size used for n: the next power of two, at least MIN_BUCKET."""
    return max(MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length())


def verify(target: KimiTarget, cache: LatentCache, tokens: jax.Array, taps: tuple[int, ...], form: MlaForm):
    """Step 3: causal target forward over the block; returns the target's argmax per position and the taps."""
    b, t = tokens.shape
    positions = cache.length[:, None] + jnp.arange(t)[None, :]
    visible = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    out = target(tokens, positions, cache, visible, taps=taps, form=form)
    return jnp.argmax(target.logits(out.hidden), axis=-1).astype(jnp.int32), out.taps, out.cache


def accept(drafts, posterior, block_len, limit, start, stop_ids):
    """Step 4 (chain): (emitted [B, block], produced [B], stopped [B]).

    ``emitted[:produced]`` are the new tokens: accepted drafts equal the target's choices, so they are simply
    the target's argmax row, the last one being the bonus.
    """
    steps = jnp.arange(drafts.shape[1])[None, :]
    matches = (drafts == posterior[:, :-1]) & (steps < block_len[:, None] - 1)
    accepted = jnp.cumprod(matches, axis=1).sum(axis=1)
    return posterior, *limit_round(posterior, accepted, limit, start, stop_ids)


def limit_round(emitted, accepted, limit, start, stop_ids):
    """(produced [B], stopped [B]): accepted + 1 tokens, cut at max length and after the first stop token."""
    produced = jnp.minimum(accepted + 1, limit - start - 1)
    is_stop = (emitted[:, :, None] == stop_ids[None, None, :]).any(-1)
    is_stop &= jnp.arange(emitted.shape[1])[None, :] < produced[:, None]
    stopped = is_stop.any(axis=1)
    produced = jnp.where(stopped, jnp.argmax(is_stop, axis=1) + 1, produced)
    return produced.astype(jnp.int32), stopped


def inject_context(drafter: DFlashDrafter, state: DecodeState, block: int) -> DraftCache:
    """Step 1: cache the drafter K/V of the tokens committed last round (the last ``context_count`` positions)."""
    start = state.target_cache.length
    positions = (start - state.context_count)[:, None] + jnp.arange(block)[None, :]
    return drafter.inject(state.draft_cache, state.context, positions, state.context_count)


def draft_stage(target: KimiTarget, drafter: DFlashDrafter, state: DecodeState, block_len: jax.Array, block: int):
    """Steps 1-2: cache last round's context in the drafter, then draft: logits [B, block - 1, V]."""
    draft_cache = inject_context(drafter, state, block)
    start = state.target_cache.length
    return drafter.draft_logits(target, draft_cache, state.bonus, start, block_len, block), draft_cache


def commit_stage(
    state: DecodeState, drafts, posterior, features, cache, draft_cache, block_len, limit, stop_ids, *trace
):
    """Steps 4-5: accept, then commit (the accepted rows already sit at start .. start + produced - 1)."""
    start = state.target_cache.length
    emitted, produced, stopped = accept(drafts, posterior, block_len, limit, start, stop_ids)
    new_state = DecodeState(
        target_cache=cache.replace(length=start + produced),
        bonus=jnp.take_along_axis(emitted, produced[:, None] - 1, axis=1)[:, 0],
        draft_cache=draft_cache,
        context=features,
        context_count=produced,
    )
    return new_state, _report(emitted, produced, stopped, *trace)


@functools.partial(jax.jit, static_argnames=("t_spec", "d_spec", "block", "form", "trace"), donate_argnames=("state",))
def dflash_round(
    t_spec: ModuleSpec,
    t_weights,
    d_spec: ModuleSpec,
    d_weights,
    state: DecodeState,
    limit,
    stop_ids,
    block,
    form,
    trace: int = 0,
):
    """One DFlash round; ``trace`` > 0 also reports the drafter's top-``trace`` tokens per position."""
    target, drafter = t_spec.merge(t_weights), d_spec.merge(d_weights)
    block_len = jnp.clip(limit - state.target_cache.length, 1, block)
    logits, draft_cache = draft_stage(target, drafter, state, block_len, block)
    drafts = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    tokens = jnp.concatenate([state.bonus[:, None], drafts], axis=1)
    posterior, features, cache = verify(target, state.target_cache, tokens, drafter.config.target_layer_ids, form)
    extra = (jax.lax.top_k(logits, trace)[1],) if trace else ()
    return commit_stage(state, drafts, posterior, features, cache, draft_cache, block_len, limit, stop_ids, *extra)


@functools.partial(
    jax.jit,
    static_argnames=("t_spec", "d_spec", "block", "budget", "max_children", "form", "trace"),
    donate_argnames=("state",),
)
def ddtree_round(
    t_spec,
    t_weights,
    d_spec,
    d_weights,
    state: DecodeState,
    limit,
    stop_ids,
    block,
    budget,
    max_children,
    form,
    trace: int = 0,
):
    """One DDTree round: draft once, build a best-first tree of ``budget`` nodes, verify it in one forward
    (each node sees the prefix and its ancestors, at position start + depth), walk the target's choices down
    the tree, and compact the accepted path's latent rows to start .. start + produced - 1. ``trace`` > 0 also
    reports the drafter's top-``trace`` tokens per position and the tree (tokens, parents; -1 where unused)."""
    target, drafter = t_spec.merge(t_weights), d_spec.merge(d_weights)
    start = state.target_cache.length
    block_len = jnp.clip(limit - start, 1, block)
    draft_cache = inject_context(drafter, state, block)
    logits = drafter.draft_logits(target, draft_cache, state.bonus, start, block_len, block)
    tree = build_tree(logits, state.bonus, block_len - 1, budget, max_children)

    taps = drafter.config.target_layer_ids
    positions = start[:, None] + tree.depths
    out = target(tree.tokens, positions, state.target_cache, tree.visible, taps=taps, form=form)
    posterior = jnp.argmax(target.logits(out.hidden), axis=-1).astype(jnp.int32)
    path, accepted = accept_path(tree, posterior, block - 1)
    emitted = jnp.take_along_axis(posterior, path, axis=1)  # the target's choices along the path: drafts + bonus
    produced, stopped = limit_round(emitted, accepted, limit, start, stop_ids)
    new_state = DecodeState(
        target_cache=compact_rows(out.cache, start, path).replace(length=start + produced),
        bonus=jnp.take_along_axis(emitted, produced[:, None] - 1, axis=1)[:, 0],
        draft_cache=draft_cache,
        context=jnp.take_along_axis(out.taps, path[:, :, None], axis=1),  # features in path order
        context_count=produced,
    )
    extra = ()
    if trace:
        unused = ~tree.valid
        extra = (
            jax.lax.top_k(logits, trace)[1],
            jnp.where(unused, -1, tree.tokens),
            jnp.where(unused, -1, tree.parents),
        )
    return new_state, _report(emitted, produced, stopped, *extra)


@functools.partial(jax.jit, static_argnames=("t_spec", "form"), donate_argnames=("state",))
def ar_step(t_spec: ModuleSpec, t_weights, state: DecodeState, stop_ids, form):
    target = t_spec.merge(t_weights)
    posterior, _, cache = verify(target, state.target_cache, state.bonus[:, None], (), form)
    token = posterior[:, 0]
    stopped = (token[:, None] == stop_ids[None, :]).any(-1)
    new_state = state.replace(target_cache=cache.replace(length=cache.length + 1), bonus=token)
    return new_state, _report(posterior, jnp.ones_like(token), stopped)


def _report(emitted, produced, stopped, *trace) -> jax.Array:
    """One int32 array [B, block + 2 + ...] (tokens | produced | stopped | flattened trace arrays): a single
    device-to-host read per round."""
    flat = [x.reshape(x.shape[0], -1).astype(jnp.int32) for x in trace]
    return jnp.concatenate([emitted, produced[:, None], stopped[:, None].astype(jnp.int32), *flat], axis=1)


@functools.partial(jax.jit, static_argnames=("t_spec", "d_spec", "taps", "block"), donate_argnames=("state",))
def prefill(t_spec, t_weights, d_spec, d_weights, state: DecodeState, tokens, prompt_len, taps, block):
    """Run the (padded) prompt, commit ``prompt_len`` tokens, pick the first token, cache the drafter context."""
    target = t_spec.merge(t_weights)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))
    visible = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    out = target(tokens, positions, state.target_cache, visible, taps=taps, form="naive")
    last = jnp.take_along_axis(out.hidden, (prompt_len - 1)[:, None, None], axis=1)
    first = jnp.argmax(target.logits(last)[:, 0], axis=-1).astype(jnp.int32)
    state = state.replace(target_cache=out.cache.replace(length=prompt_len), bonus=first)
    if d_spec is None:
        return state
    drafter = d_spec.merge(d_weights)
    draft_cache = drafter.inject(state.draft_cache, out.taps, positions, prompt_len)
    context = jnp.zeros((b, block, out.taps.shape[-1]), out.taps.dtype)
    return state.replace(draft_cache=draft_cache, context=context, context_count=jnp.zeros_like(prompt_len))


class SpeculativeDecoder:
    """Greedy generation with a target and, for ``dflash`` / ``ddtree``, a drafter; compiled once per shape bucket.

    ``attention`` picks the verify attention: ``absorbed`` (XLA), ``pallas`` (the tree-attention kernel,
    interpreted on CPU), or ``auto``: the kernel on GPU/TPU, XLA on CPU.
    """

    def __init__(
        self,
        target: Target,
        drafter: DFlashDrafter | None = None,
        attention: Literal["auto", "absorbed", "pallas"] = "auto",
    ):
        if attention not in ("auto", "absorbed", "pallas"):
            raise InputError(f"attention: expected 'auto', 'absorbed' or 'pallas', got {attention!r}")
        if attention == "auto":
            attention = "absorbed" if jax.default_backend() == "cpu" else "pallas"
        self.form: MlaForm = attention
        self.target = target
        self.drafter = drafter
        self._t_spec, self._t_weights = split_module(target.model)
        self.mesh = mesh_of(target.model)  # set when the models were placed with jaxdd.sharding.shard_module
        if drafter is not None:
            drafter.config.check_fits(target.config)
            self._d_spec, self._d_weights = split_module(drafter)

    def generate(
        self,
        prompt_ids,
        *,
        method: Method = "dflash",
        max_new_tokens: int = 64,
        stop_token_ids: list[int] | None = None,
        block_size: int | None = None,
        budget: int | None = None,
        max_children: int | None = None,
        trace_topk: int = 0,
    ) -> Generation:
        """Greedy-decode up to ``max_new_tokens`` after ``prompt_ids`` (default stops: the target's EOS ids).

        ``ddtree``: ``budget`` tree nodes per round (default block_size - 1); ``max_children`` caps the
        branching (1 verifies the DFlash chain through the tree path). ``trace_topk`` > 0 records each round's
        draft top-k (and DDTree trees) in the result.
        """
        prompt = self.target._check_tokens(prompt_ids, None)
        if prompt.shape[0] != 1:
            raise InputError(f"prompt_ids: one prompt at a time, got batch {prompt.shape[0]}")
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
        stops = list(self.target.config.eos_token_ids if stop_token_ids is None else stop_token_ids)
        if len(stops) > MAX_STOP_TOKENS:
            raise InputError(f"stop_token_ids: at most {MAX_STOP_TOKENS}, got {len(stops)}")
        if method not in ("ar", "dflash", "ddtree"):
            raise InputError(f"method: expected 'ar', 'dflash' or 'ddtree', got {method!r}")
        block, verify_width = 1, 1
        if method != "ar":
            if self.drafter is None:
                raise InputError(f"method {method!r} needs a drafter")
            block = self.drafter.config.block_size if block_size is None else block_size
            if block < 2:
                raise InputError(f"block_size: must be >= 2, got {block}")
            verify_width = block
        if method == "ddtree":
            budget = block - 1 if budget is None else budget
            if budget < 1:
                raise InputError(f"budget: must be >= 1, got {budget}")
            if max_children is not None and max_children < 1:
                raise InputError(f"max_children: must be >= 1, got {max_children}")
            verify_width = budget + 1

        prompt_len = prompt.shape[1]
        max_length = prompt_len + max_new_tokens
        if max_length > self.target.config.max_position_embeddings:
            raise InputError(
                f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                f"max_position_embeddings ({self.target.config.max_position_embeddings})"
            )
        padded = bucket(prompt_len)
        slots = bucket(max(padded, max_length + max(block, verify_width)))
        stop_ids = np.full((MAX_STOP_TOKENS,), -1, np.int32)
        stop_ids[: len(stops)] = stops

        t0 = time.perf_counter()
        state = self._prefill(prompt, padded, slots, None if method == "ar" else block)
        first = int(state.bonus[0])
        prefill_seconds = time.perf_counter() - t0

        result = Generation([first], [], prefill_seconds, 0.0)
        start, stopped = prompt_len, first in stops
        limit = np.array([max_length], np.int32)
        weights = (self._t_spec, self._t_weights)
        t0 = time.perf_counter()
        while start + 1 < max_length and not stopped:
            if method == "ar":
                state, report = ar_step(*weights, state, stop_ids, self.form)
            elif method == "dflash":
                drafter = (self._d_spec, self._d_weights)
                state, report = dflash_round(*weights, *drafter, state, limit, stop_ids, block, self.form, trace_topk)
            else:
                drafter = (self._d_spec, self._d_weights)
                tree = (block, budget, max_children, self.form, trace_topk)
                state, report = ddtree_round(*weights, *drafter, state, limit, stop_ids, *tree)
            row = np.asarray(report[0])
            width = 1 if method == "ar" else block
            produced, stopped = int(row[width]), bool(row[width + 1])
            result.tokens.extend(int(x) for x in row[:produced])
            result.acceptance_lengths.append(produced)
            if trace_topk and method != "ar":
                self._record(result, row[width + 2 :], block, trace_topk, method)
            start += produced
        result.decode_seconds = time.perf_counter() - t0
        return result

    @staticmethod
    def _record(result: Generation, trace: np.ndarray, block: int, k: int, method: Method) -> None:
        drafted = (block - 1) * k
        result.draft_topk.append(trace[:drafted].reshape(block - 1, k))
        if method == "ddtree":
            tokens, parents = np.split(trace[drafted:], 2)
            valid = tokens >= 0
            result.trees.append((tokens[valid], parents[valid]))

    def _place(self, state: DecodeState) -> DecodeState:
        """Caches on the mesh: latent rows replicated (every head reads them), drafter K/V split by KV heads."""
        shardings = jax.tree.map(lambda x: cache_sharding(x.shape, (None,) * x.ndim, self.mesh), state)
        if state.draft_cache is not None:
            kv = cache_sharding(state.draft_cache.keys.shape, (None, None, None, "kv_heads", None), self.mesh)
            shardings = shardings.replace(draft_cache=shardings.draft_cache.replace(keys=kv, values=kv))
        return jax.device_put(state, shardings)

    def _prefill(self, prompt: np.ndarray, padded: int, slots: int, block: int | None) -> DecodeState:
        tokens = np.zeros((1, padded), np.int32)
        tokens[0, : prompt.shape[1]] = prompt[0]
        dtype = self.target.dtype
        state = DecodeState(
            target_cache=LatentCache.zeros(self.target.config, 1, slots, dtype),
            bonus=jnp.zeros((1,), jnp.int32),
            draft_cache=None if block is None else DraftCache.zeros(self.drafter.config, 1, slots, dtype),
        )
        if self.mesh is not None:
            state = self._place(state)
        d_spec, d_weights, taps = None, None, ()
        if block is not None:
            d_spec, d_weights, taps = self._d_spec, self._d_weights, self.drafter.config.target_layer_ids
        prompt_len = np.array([prompt.shape[1]], np.int32)
        return prefill(self._t_spec, self._t_weights, d_spec, d_weights, state, tokens, prompt_len, taps, block)
