"""Building blocks shared by the target and the drafter:
parameters, RMSNorm, rotary embeddings, SwiGLU MLP.

Cast orders follow HF transformers / Moonshot's
``modeling_deepseek.py`` so bf16 runs round like the reference.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdd.config import YarnConfig, yarn_mscale
from jaxdd.runtime.backend import Backend

INIT_STD = 0.02  # HF initializer_range for DeepSeek-V3 / Kimi


def param(
    rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype, axes: tuple[str | None, ...]
) -> nnx.Param:
    """A normal(0, 0.02) parameter tagged with logical axis
    names (mapped to the mesh by the sharding rules)."""
    assert len(axes) == len(shape), (shape, axes)
    return nnx.Param(INIT_STD * jax.random.normal(rngs.params(), shape, dtype), logical_axes=axes)


def linear(x: jax.Array, weight: jax.Array, backend: Backend | None = None) -> jax.Array:
    """x [..., in] @ weight [in, ...] -> [..., ...]: the weight's leading
    axis is contracted, its others kept. Decoding on one CPU device, the few
    rows go through the dense matvec kernel (``Backend.dense_matvec``)."""
    rows = math.prod(x.shape[:-1])
    kernel = backend.dense_matvec(rows) if backend is not None else None
    if kernel is None:
        return jnp.tensordot(x, weight, axes=1)
    out = kernel(x.reshape(rows, x.shape[-1]), weight.reshape(weight.shape[0], -1))
    return out.reshape(*x.shape[:-1], *weight.shape[1:])


def unmerged(x: jax.Array, weight: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x`` and ``weight`` through one optimization barrier (no copy): XLA then cannot tell
    that two matmuls share ``x``, and XLA:GPU's dot merger does not fuse them into one, which
    would concatenate the weights inside every call (a copy of each weight, per round)."""
    return jax.lax.optimization_barrier((x, weight))


def project_heads(heads: jax.Array, weight: jax.Array, backend: Backend | None = None) -> jax.Array:
    """Attention output projection: heads [B, T, H, Dh] @ weight [H, Dh, D] ->
    [B, T, D], as one matmul over the flattened H * Dh. Written as an einsum over
    (H, Dh), XLA:CPU relaid the whole weight on every call to match the attention
    output's layout; flattening copies the small activation instead."""
    return linear(
        heads.reshape(*heads.shape[:-2], -1), weight.reshape(-1, weight.shape[-1]), backend
    )


def ones_param(size: int, dtype: jnp.dtype, axis: str | None) -> nnx.Param:
    return nnx.Param(jnp.ones((size,), dtype), logical_axes=(axis,))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF RMSNorm: variance in fp32, cast back to the input dtype, then multiply by the weight."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float, dtype: jnp.dtype, axis: str | None = "embed"):
        self.weight = ones_param(size, dtype, axis)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), all in the activation dtype."""

    def __init__(self, dim: int, hidden: int, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.gate = param(rngs, (dim, hidden), dtype, ("embed", "mlp"))
        self.up = param(rngs, (dim, hidden), dtype, ("embed", "mlp"))
        self.down = param(rngs, (hidden, dim), dtype, ("mlp", "embed"))

    def __call__(self, x: jax.Array, backend: Backend | None = None) -> jax.Array:
        gate = unmerged(x, self.gate[...])
        up = unmerged(x, self.up[...])
        h = jax.nn.silu(linear(*gate, backend)) * linear(*up, backend)
        return linear(h, self.down[...], backend)


# --------------------------------------------------------------------------------------------------
# Rotary embeddings


@functools.cache
def rope_frequencies(
    dim: int, theta: float, yarn: YarnConfig | None = None
) -> tuple[np.ndarray, float]:
    """Inverse frequencies [dim/2] (fp32) and the cos/sin amplitude, as transformers computes them.

    Plain RoPE without ``yarn``; otherwise YaRN with HF's ``truncate=True`` correction range.
    """
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    # theta ** e rounded once to fp32 (torch's fp32 pow agrees except for rare 1-ulp cases).
    pos_freqs = (np.float64(theta) ** exponents.astype(np.float64)).astype(np.float32)
    inv_freq_extra = np.float32(1.0) / pos_freqs
    if yarn is None:
        return inv_freq_extra, 1.0

    def correction_dim(rotations: float) -> float:
        original = yarn.original_max_position_embeddings
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / np.float32(high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    inv_freq_inter = np.float32(1.0) / (np.float32(yarn.factor) * pos_freqs)
    inv_freq = inv_freq_inter * (1 - extrapolation) + inv_freq_extra * extrapolation
    # transformers: the ratio of the two mscales when both are given, else mscale(factor) alone.
    if yarn.mscale and yarn.mscale_all_dim:
        amplitude = yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(
            yarn.factor, yarn.mscale_all_dim
        )
    else:
        amplitude = yarn_mscale(yarn.factor, 1.0)
    return inv_freq.astype(np.float32), float(amplitude)


def rope_cos_sin(
    positions: jax.Array, inv_freq: np.ndarray, amplitude: float, dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array]:
    """cos/sin [..., dim/2] for integer positions [...];
    computed in fp32, cast to the activation dtype."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return (jnp.cos(angles) * amplitude).astype(dtype), (jnp.sin(angles) * amplitude).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool) -> jax.Array:
    """Rotate the channel pairs of x [..., T, heads?, dim]
    by cos/sin [..., T, dim/2] (broadcast over heads).

    ``interleaved`` (DeepSeek/Kimi checkpoints): pairs are (x0, x1), (x2, x3), ...; the output is
    laid out [rotated evens | rotated odds] exactly as HF ``apply_rotary_pos_emb_interleave``.
    Otherwise pairs are (x_i, x_{i+dim/2}) as in ``rotate_half`` (Qwen3-style drafters).
    """
    if interleaved:
        x1 = x[..., 0::2]
        x2 = x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1 = x[..., :half]
        x2 = x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
