"""Dequantization of the two quantized Kimi checkpoint formats, in jnp (usable inside jit, e.g. in the MoE matmul).

- Kimi K2-Instruct / DeepSeek-V3: FP8 e4m3 weights with one fp32 ``weight_scale_inv`` per 128 x 128 block
  (multiplied, despite the name; partial edge blocks, e.g. the 576 rows of kv_a_proj_with_mqa).
- Kimi K2-Thinking / K2.5 / K2.6 routed experts: compressed-tensors ``pack-quantized`` INT4, symmetric, group 32:
  eight 4-bit values per int32 along the input dimension, element i at bits 4i..4i+3 (low nibble first), stored
  offset by 8; ``weight_scale`` bf16 per group. The product is formed in fp32 and rounded once, which equals
  compressed-tensors' bf16 product because |q| <= 8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_BLOCK = 128
INT4_GROUP = 32
INT4_PER_WORD = 8


def dequantize_fp8_blocks(
    weight: jax.Array, scale_inv: jax.Array, dtype: jnp.dtype = jnp.bfloat16, block: int = FP8_BLOCK
) -> jax.Array:
    """weight [..., out, in] float8_e4m3fn, scale_inv [..., ceil(out/block), ceil(in/block)] -> [..., out, in]."""
    out_features, in_features = weight.shape[-2:]
    scale = jnp.repeat(jnp.repeat(scale_inv.astype(jnp.float32), block, axis=-2), block, axis=-1)
    scale = scale[..., :out_features, :in_features]  # crop the partial edge blocks
    return (weight.astype(jnp.float32) * scale).astype(dtype)


def unpack_int4(packed: jax.Array, in_features: int) -> jax.Array:
    """packed [..., out, ceil(in/8)] int32 -> signed int4 values [..., out, in] as int8."""
    shifts = 4 * jnp.arange(INT4_PER_WORD, dtype=jnp.int32)
    nibbles = (packed[..., None] >> shifts) & 0xF  # arithmetic shift is harmless under the mask
    values = nibbles.reshape(*packed.shape[:-1], -1)[..., :in_features]
    return (values - 8).astype(jnp.int8)


def dequantize_int4_groups(
    packed: jax.Array, scale: jax.Array, in_features: int, dtype: jnp.dtype = jnp.bfloat16, group: int = INT4_GROUP
) -> jax.Array:
    """packed [..., out, in/8] int32 with scale [..., out, in/group] -> [..., out, in] in ``dtype``."""
    values = unpack_int4(packed, in_features).astype(jnp.float32)
    grouped = values.reshape(*values.shape[:-1], -1, group) * scale.astype(jnp.float32)[..., None]
    return grouped.reshape(values.shape).astype(dtype)
