"""Log-probabilities of chosen tokens, inside the jitted round and prefill."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Scores = tuple[jax.Array, jax.Array, jax.Array]  # chosen [B, n], top-k ids and values [B, n, k]


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int) -> Scores:
    """(each token's log-probability [B, n], the top-k ids and log-probabilities [B, n, k]) of
    ``tokens`` [B, n] under ``logits`` [B, n, V], untempered; the chosen token's and the top-k's
    values are read from the one log-softmax, so a token that is the argmax equals its top-1."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    top, top_ids = jax.lax.top_k(logp, k)
    return chosen, top_ids, top
