"""Log-probabilities of chosen tokens, inside the jitted round and prefill.

A round computes them only while some row asked (``lax.cond`` on the rows' flags): a log-softmax
and a top-k over the vocabulary at every emitted position cost a pass over the logits (and, with
the vocabulary split over devices, gathering it), which a round without such a request skips.
A scored prefill (``echo``) covers every prompt position in chunks of ``PROMPT_CHUNK``, so its
logits never exist at once for a whole long prompt.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdd.models.target import KimiTarget
from jaxdd.runtime.backend import Backend

Scores = tuple[jax.Array, jax.Array, jax.Array]  # chosen [B, n], top-k ids and values [B, n, k]
PROMPT_CHUNK = 256  # prompt positions whose logits a scored prefill holds at once


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int) -> Scores:
    """(each token's log-probability [B, n], the top-k ids and log-probabilities [B, n, k]) of
    ``tokens`` [B, n] under ``logits`` [B, n, V], untempered; the chosen token's and the top-k's
    values are read from the one log-softmax, so a token that is the argmax equals its top-1."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    top, top_ids = jax.lax.top_k(logp, k)
    return chosen, top_ids, top


def round_logprobs(
    logits: jax.Array,
    tokens: jax.Array,
    k: int,
    asked: jax.Array,
    at: jax.Array | None = None,
) -> Scores:
    """``token_logprobs`` of ``tokens`` [B, n] while any row of ``asked`` [B] (bool) is set, else
    zeros of its shapes (no row reads them); chosen at ``logits``'s positions ``at`` [B, n] if
    given, else at its first n."""
    b, n = tokens.shape

    def scored() -> Scores:
        chosen = logits[:, :n] if at is None else jnp.take_along_axis(logits, at[..., None], 1)
        return token_logprobs(chosen, tokens, k)

    zeros = (
        jnp.zeros((b, n), jnp.float32),
        jnp.zeros((b, n, k), jnp.int32),
        jnp.zeros((b, n, k), jnp.float32),
    )
    return jax.lax.cond(asked.any(), scored, lambda: zeros)


def prompt_logprobs(
    target: KimiTarget, hidden: jax.Array, tokens: jax.Array, k: int, backend: Backend | None
) -> Scores:
    """``token_logprobs`` of prompt tokens 1 .. T - 1 [B, T], each chosen at the position before
    it, from the final hidden states [B, T, D]; ``PROMPT_CHUNK`` positions at a time."""
    b, t, _ = hidden.shape
    chunk = min(PROMPT_CHUNK, t - 1)
    chunks = -(-(t - 1) // chunk)
    pad = chunks * chunk - (t - 1)
    inputs = jnp.pad(hidden[:, :-1], [(0, 0), (0, pad), (0, 0)])
    chosen = jnp.pad(tokens[:, 1:], [(0, 0), (0, pad)])

    def scored(part: tuple[jax.Array, jax.Array]) -> Scores:
        h, ids = part
        return token_logprobs(target.logits(h, backend), ids, k)

    def by_chunk(x: jax.Array) -> jax.Array:
        return jnp.moveaxis(x.reshape(b, chunks, chunk, *x.shape[2:]), 1, 0)

    out = jax.lax.map(scored, (by_chunk(inputs), by_chunk(chosen)))
    return tuple(
        jnp.moveaxis(x, 0, 1).reshape(b, chunks * chunk, *x.shape[3:])[:, : t - 1] for x in out
    )
