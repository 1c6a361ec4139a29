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
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxdd.cache import LatentCache, compact_rows
from jaxdd.compile_time import compile_clock
from jaxdd.config import DrafterConfig, KimiConfig
from jaxdd.drafter import DFlashDrafter, DraftCache
from jaxdd.errors import InputError
from jaxdd.jit_state import ModuleSpec, split_module
from jaxdd.sampling import GREEDY, Sampling, SamplingArrays, filtered_probs, sample, seed_keys, split_keys
from jaxdd.sharding import cache_sharding, mesh_of
from jaxdd.target import KimiTarget, MlaForm
from jaxdd.tree import accept_path, build_tree

if TYPE_CHECKING:
    from jaxdd.api import Target

Method = Literal["ar", "dflash", "ddtree"]
MAX_STOP_TOKENS = 16  # stop ids are padded to this many so their number never changes a compiled shape
MIN_BUCKET = 16
PROMPT_BUCKETS_PER_OCTAVE = 8
PROMPT_MIN_STEP = 16  # prompt sizes are multiples of this (short prompts: fewer shapes to compile)
CACHE_BUCKETS_PER_OCTAVE = 4
CACHE_ALIGN = 64  # cache sizes past this are multiples of it: the tree-attention kernel reads blocks of up to 64


@struct.dataclass
class DecodeState:
    target_cache: LatentCache
    bonus: jax.Array  # [B] int32: the newest token, at position target_cache.length, not in the cache yet
    done: jax.Array  # [B] bool: the request stopped or reached its length; its row no longer changes
    rng: jax.Array  # [B, 2] uint32: each request's random stream (sampled requests)
    draft_cache: DraftCache | None = None
    context: jax.Array | None = None  # [B, block, taps * D]: features of the tokens committed last round
    context_count: jax.Array | None = None  # [B] int32: how many rows of ``context`` are real

    @classmethod
    def empty(
        cls,
        config: KimiConfig,
        drafter_config: DrafterConfig | None,
        batch: int,
        slots: int,
        block: int,
        dtype: jnp.dtype,
        rng: jax.Array,
    ) -> DecodeState:
        """The state before the prefill: empty caches (and drafter context, with a drafter)."""
        drafter = {}
        if drafter_config is not None:
            features = len(drafter_config.target_layer_ids) * config.hidden_size
            drafter = {
                "draft_cache": DraftCache.zeros(drafter_config, batch, slots, dtype),
                "context": jnp.zeros((batch, block, features), dtype),
                "context_count": jnp.zeros((batch,), jnp.int32),
            }
        return cls(
            target_cache=LatentCache.zeros(config, batch, slots, dtype),
            bonus=jnp.zeros((batch,), jnp.int32),
            done=jnp.zeros((batch,), bool),
            rng=rng,
            **drafter,
        )


def state_shardings(state: DecodeState, mesh: jax.sharding.Mesh) -> DecodeState:
    """Where a decode state lives on a mesh: the latent rows replicated (every head reads them), the drafter's
    K/V split by KV heads, the rest replicated."""
    shardings = jax.tree.map(lambda x: cache_sharding(x.shape, (None,) * x.ndim, mesh), state)
    if state.draft_cache is None:
        return shardings
    kv_axes = (None, "kv_heads", None, None)
    keys, values = (
        [cache_sharding(x.shape, kv_axes, mesh) for x in xs]
        for xs in (state.draft_cache.keys, state.draft_cache.values)
    )
    return shardings.replace(draft_cache=shardings.draft_cache.replace(keys=tuple(keys), values=tuple(values)))


@dataclasses.dataclass
class Generation:
    """What ``generate`` returns: new tokens (prompt excluded), tokens per round, timings in seconds."""

    tokens: list[int]
    acceptance_lengths: list[int]
    prefill_seconds: float
    decode_seconds: float
    compile_seconds: float = 0.0  # part of prefill_seconds + decode_seconds spent compiling (first call per shape)
    # The round's shape with defaults filled in: {"block": B} for DFlash, plus "budget" for DDTree, {} for AR.
    round_shape: dict[str, int] = dataclasses.field(default_factory=dict)
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


@dataclasses.dataclass(frozen=True)
class Plan:
    """A batch's fixed settings: what every round of ``SpeculativeDecoder.step`` needs besides the state."""

    method: Method
    requests: int  # real rows; the batch is padded to a power of two
    max_new_tokens: list[int]
    # On the device once, not copied there again by every round.
    limit: jax.Array  # [rows] int32: prompt length + max_new_tokens
    stop_ids: jax.Array  # [rows, MAX_STOP_TOKENS] int32, -1 padded
    settings: SamplingArrays
    sampled: bool  # any row samples: compile the sampling path
    block: int
    budget: int | None
    max_children: int | None


def bucket(n: int, minimum: int = MIN_BUCKET, per_octave: int = 1, min_step: int = 1) -> int:
    """The static size used for n, at least ``minimum``: the next power of two, or the next of ``per_octave``
    evenly spaced sizes per octave (4: ..., 64, 80, 96, 112, 128, 160, ...), less padding for more shapes;
    sizes are multiples of ``min_step``."""
    power = max(minimum, 1 << (max(n, 1) - 1).bit_length())
    step = max(min_step, power // (2 * per_octave))
    return max(minimum, -(-n // step) * step)


def cache_slots(needed: int) -> int:
    """The cache size for ``needed`` slots: up to ``CACHE_ALIGN``, the next power of two; beyond, the next of four
    sizes per octave rounded up to a multiple of ``CACHE_ALIGN``. Either way whole blocks for the Pallas
    tree-attention kernel, which reads the cache in blocks of a power of two up to that many slots. Powers of two
    throughout would double a 8257-slot Kimi cache to 16384 slots, and attention reads every slot."""
    if needed <= CACHE_ALIGN:
        return bucket(needed)
    return -(-bucket(needed, per_octave=CACHE_BUCKETS_PER_OCTAVE) // CACHE_ALIGN) * CACHE_ALIGN


def verify(target: KimiTarget, cache: LatentCache, tokens: jax.Array, taps: tuple[int, ...], form: MlaForm):
    """Step 3: causal target forward over the block; returns the target's fp32 logits per position and the taps."""
    b, t = tokens.shape
    positions = cache.length[:, None] + jnp.arange(t)[None, :]
    visible = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    out = target(tokens, positions, cache, visible, taps=taps, form=form)
    return target.logits(out.hidden), out.taps, out.cache


def argmax(logits: jax.Array) -> jax.Array:
    """The first index of the maximum over the vocabulary (as ``jnp.argmax``), int32.

    Two plain reductions (the max, then the lowest index holding it) instead of ``jnp.argmax``'s variadic
    (value, index) reduction, which XLA:CPU does not vectorize: 8 x 4096 logits take 15 us instead of 65 us.
    """
    vocab = logits.shape[-1]
    best = logits.max(axis=-1, keepdims=True)
    first = jnp.where(logits == best, jnp.arange(vocab, dtype=jnp.int32), vocab).min(axis=-1)
    return jnp.minimum(first, vocab - 1)  # all-NaN rows match nothing: still a valid token id


def accept_greedy(drafts, posterior, block_len):
    """Step 4 (chain, greedy): (emitted [B, block], accepted [B]). Accepted drafts equal the target's choices,
    so the emitted tokens are simply the target's argmax row, the last one being the bonus."""
    steps = jnp.arange(drafts.shape[1])[None, :]
    matches = (drafts == posterior[:, :-1]) & (steps < block_len[:, None] - 1)
    return posterior, jnp.cumprod(matches, axis=1).sum(axis=1)


def accept_sampled(drafts, draft_probs, target_probs, block_len, keys):
    """Step 4 (chain, sampled), as ``dflash_generate``'s ``_rejection_sample``: draft i survives with
    probability min(1, p/q); the token after the last survivor comes from the residual max(p - q, 0)
    (renormalized), or from the target itself when every draft survived. Greedy rows have one-hot p and q, which
    makes this the greedy rule. Returns (emitted [B, block], accepted [B])."""
    accept_key, bonus_key = keys
    gamma = block_len - 1
    steps = jnp.arange(drafts.shape[1])[None, :]
    p = jnp.take_along_axis(target_probs[:, :-1], drafts[..., None], axis=-1)[..., 0]
    q = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
    u = jax.vmap(lambda k: jax.random.uniform(k, drafts.shape[1:]))(accept_key)
    survives = (u * q < p) & (steps < gamma[:, None])
    accepted = jnp.cumprod(survives, axis=1).sum(axis=1)
    target_row = jnp.take_along_axis(target_probs, accepted[:, None, None], axis=1)[:, 0]
    draft_row = jnp.take_along_axis(draft_probs, jnp.minimum(accepted, drafts.shape[1] - 1)[:, None, None], axis=1)
    residual = jnp.maximum(target_row - draft_row[:, 0], 0.0)
    total = residual.sum(-1, keepdims=True)
    use_residual = (accepted < gamma)[:, None] & (total > 0)
    bonus = sample(bonus_key, jnp.where(use_residual, residual / jnp.where(total > 0, total, 1.0), target_row))
    full_steps = jnp.arange(drafts.shape[1] + 1)[None, :]
    drafts_padded = jnp.concatenate([drafts, drafts[:, :1]], axis=1)
    return jnp.where(full_steps < accepted[:, None], drafts_padded, bonus[:, None]), accepted


def limit_round(emitted, accepted, limit, start, stop_ids, done):
    """(produced [B], stopped [B], done [B]): accepted + 1 tokens, cut at the request's max length and after its
    first stop token; rows already done produce nothing."""
    produced = jnp.minimum(accepted + 1, limit - start - 1)
    is_stop = (emitted[:, :, None] == stop_ids[:, None, :]).any(-1)
    is_stop &= jnp.arange(emitted.shape[1])[None, :] < produced[:, None]
    stopped = is_stop.any(axis=1) & ~done
    produced = jnp.where(stopped, jnp.argmax(is_stop, axis=1) + 1, produced)
    produced = jnp.where(done, 0, produced).astype(jnp.int32)
    return produced, stopped, done | stopped | (start + produced + 1 >= limit)


def inject_context(drafter: DFlashDrafter, state: DecodeState, block: int) -> DraftCache:
    """Step 1: cache the drafter K/V of the tokens committed last round (the last ``context_count`` positions)."""
    start = state.target_cache.length
    positions = (start - state.context_count)[:, None] + jnp.arange(block)[None, :]
    return drafter.inject(state.draft_cache, state.context, positions, state.context_count)


def draft_stage(target: KimiTarget, drafter: DFlashDrafter, state: DecodeState, block_len: jax.Array, block: int):
    """Steps 1-2: cache last round's context in the drafter, then draft: (logits [B, block - 1, V], drafter cache)."""
    draft_cache = inject_context(drafter, state, block)
    return drafter.draft_logits(target, draft_cache, state.bonus, state.target_cache.length, block_len, block)


def commit(state: DecodeState, emitted, accepted, cache, context, draft_cache, rng, limit, stop_ids, *trace):
    """Step 5: keep ``produced`` tokens per row (rows already done keep everything as it was) and report."""
    start = state.target_cache.length
    produced, stopped, done = limit_round(emitted, accepted, limit, start, stop_ids, state.done)
    last = jnp.take_along_axis(emitted, jnp.maximum(produced - 1, 0)[:, None], axis=1)[:, 0]
    new_state = DecodeState(
        target_cache=cache.replace(length=start + produced),
        bonus=jnp.where(produced > 0, last, state.bonus),
        done=done,
        rng=rng,
        draft_cache=draft_cache,
        context=context,
        context_count=None if context is None else produced,
    )
    return new_state, _report(emitted, produced, stopped, *trace)


@functools.partial(
    jax.jit, static_argnames=("t_spec", "d_spec", "block", "form", "sampled", "trace"), donate_argnames=("state",)
)
def dflash_round(
    t_spec: ModuleSpec,
    t_weights,
    d_spec: ModuleSpec,
    d_weights,
    state: DecodeState,
    limit,
    stop_ids,
    settings: SamplingArrays,
    block: int,
    form: MlaForm,
    sampled: bool = False,
    trace: int = 0,
):
    """One DFlash round; ``sampled`` compiles the rejection-sampling path (``settings`` per row), otherwise
    greedy. ``trace`` > 0 also reports the drafter's top-``trace`` tokens per position."""
    target, drafter = t_spec.merge(t_weights), d_spec.merge(d_weights)
    block_len = jnp.clip(limit - state.target_cache.length, 1, block)
    logits, draft_cache = draft_stage(target, drafter, state, block_len, block)
    rng = state.rng
    if sampled:
        rng, (draft_key, *accept_keys) = split_keys(rng, 3)
        draft_probs = filtered_probs(logits, settings)
        drafts = sample(draft_key, draft_probs)
    else:
        drafts = argmax(logits)
    tokens = jnp.concatenate([state.bonus[:, None], drafts], axis=1)
    taps = drafter.config.target_layer_ids
    target_logits, features, cache = verify(target, state.target_cache, tokens, taps, form)
    if sampled:
        target_probs = filtered_probs(target_logits, settings)
        emitted, accepted = accept_sampled(drafts, draft_probs, target_probs, block_len, accept_keys)
    else:
        emitted, accepted = accept_greedy(drafts, argmax(target_logits), block_len)
    extra = (jax.lax.top_k(logits, trace)[1],) if trace else ()
    return commit(state, emitted, accepted, cache, features, draft_cache, rng, limit, stop_ids, *extra)


@functools.partial(
    jax.jit,
    static_argnames=("t_spec", "d_spec", "block", "budget", "max_children", "form", "sampled", "trace"),
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
    settings: SamplingArrays,
    block: int,
    budget: int,
    max_children: int | None,
    form: MlaForm,
    sampled: bool = False,
    trace: int = 0,
):
    """One DDTree round: draft once, build a best-first tree of ``budget`` nodes, verify it in one forward
    (each node sees the prefix and its ancestors, at position start + depth), walk the target's choices down
    the tree, and compact the accepted path's latent rows to start .. start + produced - 1.

    Sampled rows (``sampled``) use the target-only rule: one token is sampled from the target's filtered
    distribution at every node; the walk descends while the sample is a child's token and the first sample
    that is not becomes the bonus, so every emitted token is a draw from the target (lossless for any tree).
    The tree is built from the drafter's logits at the request's temperature. ``trace`` > 0 also reports the
    drafter's top-``trace`` tokens per position and the tree (tokens, parents; -1 where unused)."""
    target, drafter = t_spec.merge(t_weights), d_spec.merge(d_weights)
    start = state.target_cache.length
    block_len = jnp.clip(limit - start, 1, block)
    logits, draft_cache = draft_stage(target, drafter, state, block_len, block)
    rng = state.rng
    tree_logits = logits
    if sampled:
        temperature = settings.temperature[:, None, None]
        tree_logits = logits / jnp.where(temperature > 0, temperature, 1.0)
    tree = build_tree(tree_logits, state.bonus, block_len - 1, budget, max_children)

    taps = drafter.config.target_layer_ids
    positions = start[:, None] + tree.depths
    out = target(tree.tokens, positions, state.target_cache, tree.visible, taps=taps, form=form)
    target_logits = target.logits(out.hidden)
    if sampled:
        rng, (choice_key,) = split_keys(rng, 1)
        choice = sample(choice_key, filtered_probs(target_logits, settings))
    else:
        choice = argmax(target_logits)
    path, accepted = accept_path(tree, choice, block - 1)
    emitted = jnp.take_along_axis(choice, path, axis=1)  # the target's choices along the path: drafts + bonus
    cache = compact_rows(out.cache, start, path)
    context = jnp.take_along_axis(out.taps, path[:, :, None], axis=1)  # features in path order
    extra = ()
    if trace:
        unused = ~tree.valid
        tree_tokens, tree_parents = jnp.where(unused, -1, tree.tokens), jnp.where(unused, -1, tree.parents)
        extra = (jax.lax.top_k(logits, trace)[1], tree_tokens, tree_parents)
    return commit(state, emitted, accepted, cache, context, draft_cache, rng, limit, stop_ids, *extra)


@functools.partial(jax.jit, static_argnames=("t_spec", "form", "sampled"), donate_argnames=("state",))
def ar_step(t_spec: ModuleSpec, t_weights, state: DecodeState, limit, stop_ids, settings, form, sampled=False):
    target = t_spec.merge(t_weights)
    logits, _, cache = verify(target, state.target_cache, state.bonus[:, None], (), form)
    logits, rng = logits[:, 0], state.rng
    if sampled:
        rng, (key,) = split_keys(rng, 1)
        token = sample(key, filtered_probs(logits, settings))
    else:
        token = argmax(logits)
    return commit(state, token[:, None], jnp.zeros_like(token), cache, None, None, rng, limit, stop_ids)


def _report(emitted, produced, stopped, *trace) -> jax.Array:
    """One int32 array [B, block + 2 + ...] (tokens | produced | stopped | flattened trace arrays): a single
    device-to-host read per round."""
    flat = [x.reshape(x.shape[0], -1).astype(jnp.int32) for x in trace]
    return jnp.concatenate([emitted, produced[:, None], stopped[:, None].astype(jnp.int32), *flat], axis=1)


@functools.partial(jax.jit, static_argnames=("t_spec", "d_spec", "taps", "block", "slots", "sampled", "mesh"))
def prefill(
    t_spec,
    t_weights,
    d_spec,
    d_weights,
    tokens,
    prompt_len,
    limit,
    stop_ids,
    settings,
    seeds,
    taps,
    block,
    slots,
    sampled,
    mesh,
) -> DecodeState:
    """Run the (padded) prompts, commit ``prompt_len`` tokens per row, choose each row's first token, and cache
    the drafter context: the decode state, with caches of ``slots`` slots (placed on ``mesh`` if given). A row is
    done at once if that token is a stop token or its length allows no more.

    The empty state is made here rather than passed in: its ~20 buffers and PRNG keys, each made by its own
    eager dispatch, took ~2-4 ms of host time before the prefill could start (a fifth of a HumanEval prefill)."""
    target = t_spec.merge(t_weights)
    drafter = None if d_spec is None else d_spec.merge(d_weights)
    b, t = tokens.shape
    state = DecodeState.empty(
        target.config, None if drafter is None else drafter.config, b, slots, block, target.dtype, seed_keys(seeds)
    )
    positions = jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))
    visible = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    # The cache is empty: the prompt attends over a cache of its own length, whose rows are then copied into the
    # first slots, instead of over every slot (a 160-token prompt in a 256-slot cache: ~1/3 less attention).
    cache = state.target_cache
    prompt_cache = LatentCache.zeros(target.config, b, t, cache.latent[0].dtype)
    out = target(tokens, positions, prompt_cache, visible, taps=taps, form="naive")
    latent, rope = jax.tree.map(
        lambda full, rows: full.at[:, :t].set(rows), (cache.latent, cache.rope), (out.cache.latent, out.cache.rope)
    )
    cache = cache.replace(latent=latent, rope=rope, length=prompt_len)
    last = jnp.take_along_axis(out.hidden, (prompt_len - 1)[:, None, None], axis=1)
    logits = target.logits(last)[:, 0]
    rng = state.rng
    if sampled:
        rng, (key,) = split_keys(rng, 1)
        first = sample(key, filtered_probs(logits, settings))
    else:
        first = argmax(logits)
    done = (first[:, None] == stop_ids).any(-1) | (prompt_len + 1 >= limit)
    state = state.replace(target_cache=cache, bonus=first, rng=rng, done=done)
    if drafter is not None:
        state = state.replace(draft_cache=drafter.inject(state.draft_cache, out.taps, positions, prompt_len))
    if mesh is not None:
        state = jax.lax.with_sharding_constraint(state, state_shardings(state, mesh))
    return state


class SpeculativeDecoder:
    """Greedy generation with a target and, for ``dflash`` / ``ddtree``, a drafter; compiled once per shape bucket.

    ``attention`` picks the verify attention: ``absorbed`` (XLA), ``pallas`` (the tree-attention kernel,
    interpreted on CPU), or ``auto``: the kernel on GPUs (where it was measured faster in bf16), XLA elsewhere.
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
            attention = "pallas" if jax.default_backend() == "gpu" else "absorbed"
        self.form: MlaForm = attention
        self.target = target
        self.drafter = drafter
        self._t_spec, self._t_weights = split_module(target.model)
        self.mesh = mesh_of(target.model)  # set when the models were placed with jaxdd.sharding.shard_module
        if drafter is not None:
            drafter.config.check_fits(target.config)
            self._d_spec, self._d_weights = split_module(drafter)

    def generate(self, prompt_ids, *, sampling: Sampling = GREEDY, **options) -> Generation:
        """Decode up to ``max_new_tokens`` after one prompt; see ``generate_batch`` for the options."""
        prompt = self.target._check_tokens(prompt_ids, None)
        if prompt.shape[0] != 1:
            raise InputError(f"prompt_ids: one prompt at a time, got batch {prompt.shape[0]}; use generate_batch")
        return self.generate_batch([prompt[0].tolist()], sampling=sampling, **options)[0]

    def generate_batch(
        self,
        prompts: list[list[int]],
        *,
        trace_topk: int = 0,
        on_tokens: Callable[[int, list[int]], None] | None = None,
        **options,
    ) -> list[Generation]:
        """Decode a batch of requests together, each with its own length, sampling settings and seed.

        Greedy and sampled requests mix freely; a request that stops early stops changing while the others go on.
        The batch is padded to a power of two (and prompts and the cache to their buckets), so shapes repeat.
        Options: ``sampling`` (one ``Sampling`` or one per prompt; default greedy), ``method`` ("ar", "dflash",
        "ddtree"), ``max_new_tokens`` (one or one per prompt), ``stop_token_ids`` (default: the target's EOS ids),
        ``block_size``, ``budget`` (DDTree nodes per round, default block_size - 1), ``max_children`` (caps the
        branching; 1 verifies the DFlash chain through the tree path). ``trace_topk`` > 0 records each round's
        draft top-k (and DDTree trees) in the results. ``on_tokens(request, new_tokens)`` is called as tokens are
        accepted (the first one after the prefill, then each round's), e.g. to stream text.
        """
        emit = on_tokens or (lambda request, tokens: None)
        with compile_clock() as clock:
            t0 = time.perf_counter()
            plan, state = self.start(prompts, **options)
            first, done = np.asarray(state.bonus), np.array(state.done)
            prefill_seconds = time.perf_counter() - t0
            n, method, block = plan.requests, plan.method, plan.block
            results = [Generation([int(first[i])], [], prefill_seconds, 0.0) for i in range(n)]
            for i in range(n):
                emit(i, results[i].tokens[:])
            width = 1 if method == "ar" else block  # tokens per report row
            t0 = time.perf_counter()
            pending = None if done[:n].all() else self.step(plan, state, trace_topk)
            while pending is not None:
                state, report = pending
                # Dispatch the next round before reading this one's report, so the host's work (the wait for the
                # report, the bookkeeping, the next dispatch) overlaps the device's: ~0.3 ms per round on CPU, a
                # fifth of an AR step. Not when a request may reach its length this round: a round after the last
                # would be wasted work (after a stop token it still is: finished rows change nothing).
                may_end = any(
                    not done[i] and len(results[i].tokens) + width >= plan.max_new_tokens[i] for i in range(n)
                )
                pending = None if may_end else self.step(plan, state, trace_topk)
                report = np.asarray(report)
                for i, (row, result) in enumerate(zip(report, results, strict=False)):
                    produced = int(row[width])
                    if produced:
                        new = [int(x) for x in row[:produced]]
                        result.tokens.extend(new)
                        result.acceptance_lengths.append(produced)
                        emit(i, new)
                        if trace_topk and method != "ar":
                            self._record(result, row[width + 2 :], block, trace_topk, method)
                    done[i] = done[i] or bool(row[width + 1]) or len(result.tokens) >= plan.max_new_tokens[i]
                if done[:n].all():
                    jax.block_until_ready(pending)  # a round dispatched ahead finishes in this call's time
                    pending = None
                elif pending is None:
                    pending = self.step(plan, state, trace_topk)
            decode_seconds = time.perf_counter() - t0
        round_shape = {} if method == "ar" else {"block": block}
        if method == "ddtree":
            round_shape["budget"] = plan.budget
        for result in results:
            result.decode_seconds = decode_seconds
            result.compile_seconds = clock.seconds
            result.round_shape = dict(round_shape)
        return results

    def step(self, plan: Plan, state: DecodeState, trace_topk: int = 0) -> tuple[DecodeState, jax.Array]:
        """One jitted round for the whole batch: (new state, the round's report [rows, ...])."""
        weights = (self._t_spec, self._t_weights)
        common = (plan.limit, plan.stop_ids, plan.settings)
        if plan.method == "ar":
            return ar_step(*weights, state, *common, self.form, plan.sampled)
        drafter = (self._d_spec, self._d_weights)
        if plan.method == "dflash":
            return dflash_round(*weights, *drafter, state, *common, plan.block, self.form, plan.sampled, trace_topk)
        tree = (plan.block, plan.budget, plan.max_children, self.form, plan.sampled, trace_topk)
        return ddtree_round(*weights, *drafter, state, *common, *tree)

    def start(
        self,
        prompts: list[list[int]],
        *,
        sampling: Sampling | list[Sampling] = GREEDY,
        method: Method = "dflash",
        max_new_tokens: int | list[int] = 64,
        stop_token_ids: list[int] | None = None,
        block_size: int | None = None,
        budget: int | None = None,
        max_children: int | None = None,
    ) -> tuple[Plan, DecodeState]:
        """Check the requests, fix the static shapes and run the prefill: (plan, state after the prefill)."""
        if not prompts:
            raise InputError("prompts: the batch is empty")
        checked = [self.target._check_tokens([list(p)], None)[0] for p in prompts]
        n = len(checked)
        settings = [sampling] * n if isinstance(sampling, Sampling) else list(sampling)
        lengths = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(settings) != n or len(lengths) != n:
            raise InputError(f"sampling and max_new_tokens: give one per prompt ({n}), or one for all")
        if any(not isinstance(m, int) or m < 1 for m in lengths):
            raise InputError(f"max_new_tokens: must be >= 1 (an integer, or one per prompt), got {max_new_tokens}")
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

        limits = [len(p) + m for p, m in zip(checked, lengths, strict=True)]
        if max(limits) > self.target.config.max_position_embeddings:
            i = int(np.argmax(limits))
            raise InputError(
                f"request {i}: prompt ({len(checked[i])}) + max_new_tokens ({lengths[i]}) exceeds the model's "
                f"max_position_embeddings ({self.target.config.max_position_embeddings})"
            )
        rows = bucket(n, minimum=1)
        # Prompts in eighth octaves, multiples of 16: the prefill's cost grows with the padded length (~70 us a
        # token for kimi-mini on CPU; powers of two padded a 131-token HumanEval prompt to 256, quarter octaves to
        # 160, now 144), and a prefill shape compiles in ~1 s. The cache in quarter octaves: a round's cost grows
        # with its slots (a DFlash round at 512 slots took ~12% longer than at 256 on CPU).
        padded = bucket(max(len(p) for p in checked), per_octave=PROMPT_BUCKETS_PER_OCTAVE, min_step=PROMPT_MIN_STEP)
        slots = cache_slots(max(padded, max(limits) + max(block, verify_width)))
        tokens = np.zeros((rows, padded), np.int32)
        prompt_len = np.ones((rows,), np.int32)
        limit = np.full((rows,), 2, np.int32)  # padding rows: a one-token request, done after the prefill
        for i, prompt in enumerate(checked):
            tokens[i, : len(prompt)], prompt_len[i], limit[i] = prompt, len(prompt), limits[i]
        stop_ids = np.full((rows, MAX_STOP_TOKENS), -1, np.int32)
        stop_ids[:, : len(stops)] = stops
        settings = settings + [GREEDY] * (rows - n)
        arrays, sampled = SamplingArrays.of(settings), any(not s.greedy for s in settings)

        # On the device in one transfer: the prefill and every round read them.
        limit, stop_ids, arrays = jax.device_put((limit, stop_ids, arrays))
        plan = Plan(
            method=method,
            requests=n,
            max_new_tokens=lengths,
            limit=limit,
            stop_ids=stop_ids,
            settings=arrays,
            sampled=sampled,
            block=block,
            budget=budget,
            max_children=max_children,
        )
        return plan, self._prefill(tokens, prompt_len, limit, stop_ids, settings, arrays, slots, block, sampled, method)

    @staticmethod
    def _record(result: Generation, trace: np.ndarray, block: int, k: int, method: Method) -> None:
        drafted = (block - 1) * k
        result.draft_topk.append(trace[:drafted].reshape(block - 1, k))
        if method == "ddtree":
            tokens, parents = np.split(trace[drafted:], 2)
            valid = tokens >= 0
            result.trees.append((tokens[valid], parents[valid]))

    def _prefill(self, tokens, prompt_len, limit, stop_ids, settings, arrays, slots, block, sampled, method):
        d_spec, d_weights, taps = None, None, ()
        if method != "ar":
            d_spec, d_weights, taps = self._d_spec, self._d_weights, self.drafter.config.target_layer_ids
        seeds = np.array([s.seed for s in settings], np.uint32)
        inputs = (tokens, prompt_len, limit, stop_ids, arrays, seeds)
        return prefill(
            self._t_spec, self._t_weights, d_spec, d_weights, *inputs, taps, block, slots, sampled, self.mesh
        )
