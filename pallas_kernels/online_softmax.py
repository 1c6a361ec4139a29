"""The online softmax the tree-attention forms share, and the merge of partial softmaxes.

A kernel folds key blocks into a running (acc, max, sum) per query row (``online_softmax_step``);
its log-sum-exp (``log_sum_exp``) lets attentions over disjoint parts of the keys merge exactly
(``merge_by_lse``): pages striped over devices, key splits inside a kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

NEG = -1e30  # finite: neither a fully masked block nor a merge of lse may meet (-inf) - (-inf)


def widened(keys: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``keys`` in ``dtype`` where they are stored narrower (the kernels compute in the
    queries' dtype); as they are otherwise."""
    return keys.astype(dtype) if keys.dtype.itemsize < jnp.dtype(dtype).itemsize else keys


def online_softmax_step(carry, q_lat, q_rope, latent, rope, visible, scale: float):
    """One block of keys into the running softmax (shared by the GPU and
    TPU forms): carry = (acc [rows, r] fp32, max [rows, 1], sum [rows, 1]);
    ``visible`` [rows or 1, keys] masks scores; returns the new carry.

    Operands enter the dots in the queries' dtype with fp32 accumulation (bf16 x bf16
    products are exact in fp32, and the tensor cores / MXU take bf16); a cache stored
    narrower (8-bit floats) is widened to it block by block. The softmax runs in fp32 and
    the probabilities meet the values in that dtype too, as in flash attention. fp32 inputs
    stay fp32 throughout (Triton's IEEE dot)."""
    acc, m, total = carry
    latent, rope = widened(latent, q_lat.dtype), widened(rope, q_rope.dtype)
    scores = jnp.dot(q_lat, latent.T, preferred_element_type=jnp.float32)
    scores += jnp.dot(q_rope, rope.T, preferred_element_type=jnp.float32)
    scores = jnp.where(visible, scores * scale, NEG)
    m_new = jnp.maximum(m, scores.max(-1, keepdims=True))
    correction = jnp.exp(m - m_new)
    p = jnp.where(visible, jnp.exp(scores - m_new), 0.0)
    acc = correction * acc + jnp.dot(
        p.astype(latent.dtype), latent, preferred_element_type=jnp.float32
    )
    return acc, m_new, correction * total + p.sum(-1, keepdims=True)


def log_sum_exp(m: jax.Array, total: jax.Array) -> jax.Array:
    """The log-sum-exp [rows, 1] of the running softmax's final (max, sum); ``NEG`` where a row
    saw no key (its max is ``NEG``, its sum 0)."""
    return jnp.where(total == 0, NEG, m + jnp.log(total))


def merge_by_lse(
    out: jax.Array,
    lse: jax.Array,
    max_over_parts: Callable[[jax.Array], jax.Array],
    sum_over_parts: Callable[[jax.Array], jax.Array],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Attention over disjoint parts of the keys merged exactly from each part's output
    ``out`` [..., r] and log-sum-exp ``lse`` [...] (fp32): the one merge of pages striped over
    devices (the reducers are collectives) and of key splits inside a kernel (an array axis).
    ``max_over_parts`` keeps the shape; ``sum_over_parts`` may reduce or scatter the parts.
    Returns (merged out, sum of the parts' weights, their largest lse): a part that saw nothing
    (lse ``NEG``) weighs 0 unless no part saw anything (then every out is 0, and so is the
    merge)."""
    top = max_over_parts(lse)
    weight = jnp.exp(lse - top)
    total = sum_over_parts(weight)
    return sum_over_parts(out * weight[..., None]) / total[..., None], total, top


def merge_splits(out: jax.Array, lse: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """``merge_by_lse`` over an array ``axis`` of parts: (out, lse) without it; lse ``NEG``
    where no part saw a key."""
    merged, total, top = merge_by_lse(
        out, lse, lambda x: x.max(axis, keepdims=True), lambda x: x.sum(axis)
    )
    top = top.squeeze(axis)
    return merged, jnp.where(top <= NEG, NEG, top + jnp.log(total))
