"""Per-request sampling settings and the filtered distributions every decoding method samples from.

``filtered_probs`` follows z-lab ``dflash.model._sampling_probs``: logits / temperature,
keep the ``top_k`` largest, softmax, keep the smallest prefix of the sorted probabilities
whose mass reaches ``top_p`` (the token that crosses it included), renormalize.
Temperature 0 is greedy: the distribution is one-hot on the argmax, so the sampling code
paths reduce exactly to the greedy ones and greedy and sampled requests can share a
batch. Settings are per row arrays, so mixing them never changes a compiled shape.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxdd.errors import InputError


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy; top_p in (0, 1]; top_k 0
    = no limit; seed makes a request reproducible."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        if (
            not (isinstance(self.temperature, (int, float)) and np.isfinite(self.temperature))
            or self.temperature < 0
        ):
            raise InputError.at(
                "temperature", f"must be a finite number >= 0, got {self.temperature!r}"
            )
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise InputError.at("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if (
            not isinstance(self.top_k, (int, np.integer))
            or isinstance(self.top_k, bool)
            or self.top_k < 0
        ):
            raise InputError.at(
                "top_k", f"must be an integer >= 0 (0 = no limit), got {self.top_k!r}"
            )
        if (
            not isinstance(self.seed, (int, np.integer))
            or isinstance(self.seed, bool)
            or not 0 <= self.seed < 2**32
        ):
            raise InputError.at("seed", f"must be an integer in [0, 2**32), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    """The settings of a batch, one entry per row."""

    temperature: jax.Array  # [B] float32
    top_p: jax.Array  # [B] float32
    top_k: jax.Array  # [B] int32

    @classmethod
    def of(cls, settings: list[Sampling]) -> SamplingArrays:
        """Host (numpy) arrays: the caller moves them to the device together with its other inputs,
        in one ``device_put`` (one eager ``jnp.asarray`` per array costs a dispatch each)."""
        return cls(
            temperature=np.array([s.temperature for s in settings], np.float32),
            top_p=np.array([s.top_p for s in settings], np.float32),
            top_k=np.array([s.top_k for s in settings], np.int32),
        )


def argmax(logits: jax.Array) -> jax.Array:
    """The first index of the maximum over the vocabulary (as ``jnp.argmax``), int32.

    Two plain reductions (the max, then the lowest index holding it) instead of
    ``jnp.argmax``'s variadic (value, index) reduction, which XLA:CPU does not vectorize.
    """
    vocab = logits.shape[-1]
    best = logits.max(axis=-1, keepdims=True)
    first = jnp.where(logits == best, jnp.arange(vocab, dtype=jnp.int32), vocab).min(axis=-1)
    return jnp.minimum(first, vocab - 1)  # all-NaN rows match nothing: still a valid token id


def seed_keys(seeds: jax.Array) -> jax.Array:
    """[B, 2] uint32 raw PRNG keys, one stream per request, for the requests' seeds [B] uint32."""
    return jax.vmap(lambda seed: jax.random.key_data(jax.random.PRNGKey(seed)))(seeds)


def split_keys(keys: jax.Array, count: int) -> tuple[jax.Array, list[jax.Array]]:
    """Advance each row's stream: (next keys [B, 2],
    ``count`` typed keys of shape [B] for this step)."""
    # [B, count+1]
    split = jax.vmap(lambda k: jax.random.split(jax.random.wrap_key_data(k), count + 1))(keys)
    return jax.random.key_data(split[:, 0]), [split[:, i] for i in range(1, count + 1)]


# the top-k / top-p cut-offs are looked for among each row's this many most likely tokens
CANDIDATES = 64


def filtered_probs(logits: jax.Array, settings: SamplingArrays, ways: int = 2) -> jax.Array:
    """fp32 probabilities [B, ..., V] to sample from, for logits [B, ..., V] and per-row settings.

    The top-k and top-p cut-offs come from the ``CANDIDATES`` most likely tokens, as the sorted
    formulation finds them (ties included), without sorting the vocabulary: a sort per row dominates
    a sampled round on XLA:CPU (benchmarks/README.md, "What temperature costs"). A cut-off beyond
    the candidates is found by a search over the values' bits that tests ``ways - 1`` thresholds per
    read of the values (2: a bisection; ``Backend.cut_off_ways``), only when some row needs it."""
    vocab = logits.shape[-1]
    expand = (slice(None),) + (None,) * (logits.ndim - 1)
    temperature = settings.temperature[expand]
    top_p = settings.top_p[expand]
    top_k = settings.top_k[expand]
    scores = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)
    limited = (top_k > 0) & (top_k < vocab)
    nucleus = top_p < 1
    cut = lambda: _cut_off(
        scores, jnp.where(limited, top_k, 0), jnp.where(nucleus, top_p, 1.0), ways
    )
    probs = jax.lax.cond((limited | nucleus).any(), cut, lambda: jax.nn.softmax(scores, axis=-1))
    greedy = temperature == 0  # one-hot on the argmax; computed only when some row is greedy
    return _where_any(
        greedy, lambda: jax.nn.one_hot(argmax(logits), vocab, dtype=jnp.float32), probs
    )


def _cut_off(scores: jax.Array, top_k: jax.Array, top_p: jax.Array, ways: int) -> jax.Array:
    """softmax(scores) cut to the top_k largest (0: no cut)
    and to the top_p nucleus (1: no cut), renormalized."""
    vocab = scores.shape[-1]
    candidates = min(CANDIDATES, vocab)
    top_scores, ids = jax.lax.top_k(scores, candidates)
    limited = top_k > 0
    kth = jnp.take_along_axis(top_scores, jnp.clip(top_k - 1, 0, candidates - 1), axis=-1)
    kth = _where_any(
        top_k > candidates, lambda: _kth_largest(scores, jnp.clip(top_k, 1, vocab), ways), kth
    )
    probs = jax.nn.softmax(jnp.where(limited & (scores < kth), -jnp.inf, scores), axis=-1)
    # Nucleus: keep the sorted prefix whose mass before each token is still below top_p (the
    # token that crosses it included), then every token as likely as the last one kept.
    nucleus = top_p < 1
    sorted_probs = jnp.take_along_axis(probs, ids, axis=-1)
    kept = (jnp.cumsum(sorted_probs, axis=-1) - sorted_probs < top_p).sum(-1, keepdims=True)
    floor = jnp.take_along_axis(sorted_probs, kept - 1, axis=-1)
    floor = _where_any(
        nucleus & (kept >= candidates), lambda: _nucleus_floor(probs, top_p, ways), floor
    )
    probs = jnp.where(nucleus & (probs < floor), 0.0, probs)
    return probs / probs.sum(-1, keepdims=True)


def _where_any(needed: jax.Array, compute, otherwise: jax.Array) -> jax.Array:
    """``compute()`` where ``needed``, else ``otherwise``;
    ``compute`` runs only when some row needs it."""
    return jax.lax.cond(
        needed.any(), lambda: jnp.where(needed, compute(), otherwise), lambda: otherwise
    )


def _ordered(x: jax.Array) -> jax.Array:
    """int32 keys with the floats' order (x < y exactly
    when key(x) < key(y), for non-NaN floats)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _float_of(key: jax.Array) -> jax.Array:
    """The float whose ``_ordered`` key this is (the mapping is its own inverse on the bits)."""
    return jax.lax.bitcast_convert_type(
        jnp.where(key < 0, key ^ jnp.int32(0x7FFFFFFF), key), jnp.float32
    )


def _search(holds, low: jax.Array, high: jax.Array, ways: int) -> jax.Array:
    """The smallest key in (low, high] [..., 1] where ``holds`` (monotone: false at low, true
    at high) holds; ``holds(thresholds [..., ways - 1])`` tests them at once. Each pass cuts
    the bracket into ``ways`` parts, so log_ways(2**32) passes pin an int32 key down."""
    if ways < 2 or ways & (ways - 1):
        raise ValueError(f"ways: expected a power of 2 from 2, got {ways}")
    passes = -(-32 // (ways.bit_length() - 1))
    as_unsigned = lambda k: jax.lax.bitcast_convert_type(k, jnp.uint32)
    parts = jnp.arange(1, ways, dtype=jnp.uint32)

    def step(_, bracket):
        low, high = bracket
        width = as_unsigned(high) - as_unsigned(low)  # exact modulo 2**32, and high - low < 2**32
        offsets = jnp.minimum(parts * (width // ways + (width % ways > 0)), width)
        # ascending, <= high
        thresholds = jax.lax.bitcast_convert_type(as_unsigned(low) + offsets, jnp.int32)
        passed = holds(thresholds)
        first = jnp.argmax(
            jnp.concatenate([passed, jnp.ones_like(passed[..., :1])], -1), -1, keepdims=True
        )
        edges = jnp.concatenate([low, thresholds, high], -1)
        return jnp.take_along_axis(edges, first, -1), jnp.take_along_axis(edges, first + 1, -1)

    return jax.lax.fori_loop(0, passes, step, (low, high))[1]


def _kth_largest(scores: jax.Array, k: jax.Array, ways: int) -> jax.Array:
    """Each row's k-th largest score [..., 1]: the smallest t with fewer than k scores above t."""
    # Keyed again inside each pass, so a pass reads only the
    # scores (a key array would be written and read too).
    fewer = lambda t: (_ordered(scores)[..., None, :] > t[..., None]).sum(-1) < k
    keys = _ordered(scores)
    return _float_of(
        _search(fewer, keys.min(-1, keepdims=True) - 1, keys.max(-1, keepdims=True), ways)
    )


def _nucleus_floor(probs: jax.Array, top_p: jax.Array, ways: int) -> jax.Array:
    """The smallest kept probability [..., 1]: the smallest
    p whose strictly larger mass is below top_p."""
    above = lambda t: jnp.where(
        _ordered(probs)[..., None, :] > t[..., None], probs[..., None, :], 0.0
    )
    below = lambda t: above(t).sum(-1) < top_p
    top = _ordered(probs).max(-1, keepdims=True)
    return _float_of(_search(below, jnp.full_like(top, -1), top, ways))


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
    """One token per distribution: probs [B, ..., V] with keys [B] -> int32 [B, ...].

    By inverse CDF with one uniform per distribution, in two levels (which block of ~sqrt(V) tokens,
    then which token in it), so no cumulative sum or random number spans the vocabulary (as
    Gumbel-max sampling's random number per token and variadic argmax over the whole vocabulary
    would)."""
    vocab = probs.shape[-1]
    block = 1 << max(vocab - 1, 1).bit_length() // 2  # a power of two near sqrt(vocab)
    blocks = -(-vocab // block)
    padded = jnp.pad(probs, [(0, 0)] * (probs.ndim - 1) + [(0, blocks * block - vocab)])
    padded = padded.reshape(*probs.shape[:-1], blocks, block)
    block_mass = padded.sum(-1)
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    u = (
        jax.vmap(lambda k: jax.random.uniform(k, probs.shape[1:-1]))(key)[..., None]
        * block_cdf[..., -1:]
    )
    chosen = jnp.minimum((block_cdf <= u).sum(-1, keepdims=True), _last_positive(block_mass))
    inside = jnp.take_along_axis(padded, chosen[..., None], axis=-2)[..., 0, :]
    before = jnp.take_along_axis(block_cdf - block_mass, chosen, axis=-1)
    index = jnp.minimum(
        (before + jnp.cumsum(inside, axis=-1) <= u).sum(-1, keepdims=True), _last_positive(inside)
    )
    return (chosen * block + index)[..., 0].astype(jnp.int32)


def _last_positive(weights: jax.Array) -> jax.Array:
    """The index of the last positive weight [..., 1]: where
    a draw that rounding carried past the total lands."""
    return jnp.max(jnp.where(weights > 0, jnp.arange(weights.shape[-1]), 0), axis=-1, keepdims=True)
