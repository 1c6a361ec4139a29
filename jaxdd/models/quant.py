"""Dequantization of the two quantized Kimi checkpoint
formats, in jnp (usable inside jit, e.g. in the MoE matmul).

- Kimi K2-Instruct / DeepSeek-V3: FP8 e4m3 weights with one fp32
  ``weight_scale_inv`` per 128 x 128 block (multiplied, despite the
  name; partial edge blocks, e.g. the 576 rows of kv_a_proj_with_mqa).
- Kimi K2-Thinking / K2.5 / K2.6 routed experts: compressed-tensors ``pack-quantized`` INT4,
  symmetric, group 32: eight 4-bit values per int32 along the input dimension, element i at bits
  4i..4i+3 (low nibble first), stored offset by 8; ``weight_scale`` bf16 per group. The product is
  formed in fp32 and rounded once, which equals compressed-tensors' bf16 product because |q| <= 8.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdd.models.layers import param

FP8_BLOCK = 128
INT4_GROUP = 32
INT4_PER_WORD = 8


def dequantize_fp8_blocks(
    weight: jax.Array, scale_inv: jax.Array, dtype: jnp.dtype = jnp.bfloat16, block: int = FP8_BLOCK
) -> jax.Array:
    """weight [..., out, in] float8_e4m3fn, scale_inv [...,
    ceil(out/block), ceil(in/block)] -> [..., out, in]."""
    out_features, in_features = weight.shape[-2:]
    scale = jnp.repeat(jnp.repeat(scale_inv.astype(jnp.float32), block, axis=-2), block, axis=-1)
    scale = scale[..., :out_features, :in_features]  # crop the partial edge blocks
    return (weight.astype(jnp.float32) * scale).astype(dtype)


def unpack_int4(packed: jax.Array, in_features: int, shifts: bool = False) -> jax.Array:
    """packed [..., out, ceil(in/8)] int32 -> signed int4 values [..., out, in] as int8.

    A bitcast to XLA's uint4 (low nibble first, as compressed-tensors packs) rather than shifts and
    masks: XLA unpacks its own 4-bit type in vectorized code. ``shifts``: the same values by shifts
    and masks, elementwise on the words, which XLA:GPU fuses with a gather of the words into the
    matmul that reads them (the bitcast's change of element type ends a fusion: the gathered experts
    would be written out and read again)."""
    if shifts:
        nibbles = (packed[..., None] >> (4 * jnp.arange(8, dtype=jnp.int32))) & 15
    else:
        nibbles = jax.lax.bitcast_convert_type(packed, jnp.uint4)  # [..., out, words, 8]
    values = nibbles.reshape(*packed.shape[:-1], -1)[..., :in_features]
    return (values.astype(jnp.int8) - 8).astype(jnp.int8)


def dequantize_int4_groups(
    packed: jax.Array,
    scale: jax.Array,
    in_features: int,
    dtype: jnp.dtype = jnp.bfloat16,
    group: int = INT4_GROUP,
    shifts: bool = False,
) -> jax.Array:
    """packed [..., out, in/8] int32 with scale [..., out, in/group] -> [...,
    out, in] in ``dtype`` (``shifts``: unpacked by shifts, ``unpack_int4``)."""
    values = unpack_int4(packed, in_features, shifts).astype(jnp.float32)
    grouped = values.reshape(*values.shape[:-1], -1, group) * scale.astype(jnp.float32)[..., None]
    return grouped.reshape(values.shape).astype(dtype)


# --- Routed-expert weight storage -----------------------------------------------------------------
# Routed experts hold nearly all of a Kimi model's bytes, so a converted checkpoint keeps them in
# the source checkpoint's quantized form (HF orientation [E, out, in], exactly as stored) and the
# MoE dequantizes them inside its jitted matmul. Everything else is dequantized at conversion time.


@dataclasses.dataclass(frozen=True)
class ExpertFormat:
    """How an MoE layer's routing weights are stored. The experts: ``dense`` (the
    model dtype), ``int4`` (compressed-tensors pack-quantized, symmetric, ``group``
    inputs per bf16 scale) or ``fp8`` (e4m3 with fp32 ``block`` x ``block``
    scales). ``router``: the router's gate weight, held as the checkpoint stores it
    (its scores are computed in fp32 either way, as HF does after upcasting it)."""

    kind: Literal["dense", "int4", "fp8"] = "dense"
    group: int = INT4_GROUP
    block: int = FP8_BLOCK
    router: Literal["float32", "bfloat16"] = "float32"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ExpertFormat:
        return cls(**data)


DENSE = ExpertFormat()


class ExpertWeights(nnx.Module):
    """One projection's stacked routed-expert weights, in whatever form they are stored.

    ``PIECES`` are the stored arrays. They share one layout: ``axes`` names the
    logical axes of ``shape`` (the dense shape in stored orientation), and a dimension
    may only be split across devices in multiples of its ``units`` (a quantization
    group or block), so every piece splits at the same boundaries. Calling the module
    gives the dense [E, in, out] weight in the model dtype; ``dequantize`` does the
    same for pieces given explicitly (a device's shard of them, inside ``shard_map``).
    """

    PIECES: tuple[str, ...] = ()
    shape: tuple[int, int, int]
    axes: tuple[str, str, str]
    units: tuple[int, int, int]

    def stored(self) -> tuple[jax.Array, ...]:
        return tuple(getattr(self, name)[...] for name in self.PIECES)

    def dequantize(self, *pieces: jax.Array) -> jax.Array:
        raise NotImplementedError

    def __call__(self) -> jax.Array:
        return self.dequantize(*self.stored())


class DenseExperts(ExpertWeights):
    """[E, in, out] weights in the model dtype."""

    PIECES = ("weight",)

    def __init__(
        self,
        rngs: nnx.Rngs,
        shape: tuple[int, int, int],
        dtype: jnp.dtype,
        axes: tuple[str, str, str],
    ):
        self.shape = shape
        self.axes = axes
        self.units = (1, 1, 1)
        self.weight = param(rngs, shape, dtype, axes)

    def dequantize(self, weight: jax.Array) -> jax.Array:
        return weight


class Int4Experts(ExpertWeights):
    """packed [E, out, ceil(in/8)] int32 and scale [E, out, in/group] bf16, dequantized like
    compressed-tensors (product in the scale's dtype) and then cast to the model dtype."""

    PIECES = ("packed", "scale")

    def __init__(
        self, shape: tuple[int, int, int], dtype: jnp.dtype, axes: tuple[str, str, str], group: int
    ):
        e, n_in, n_out = shape
        if n_in % group:
            raise ValueError(
                f"INT4 experts: input size {n_in} is not a multiple of the group size {group}"
            )
        self.dtype = dtype
        self.group = group
        self.shape = (e, n_out, n_in)
        self.axes = (axes[0], axes[2], axes[1])
        self.units = (1, 1, group)
        self.packed = nnx.Param(
            jnp.zeros((e, n_out, -(-n_in // INT4_PER_WORD)), jnp.int32), logical_axes=self.axes
        )
        self.scale = nnx.Param(
            jnp.ones((e, n_out, n_in // group), jnp.bfloat16), logical_axes=self.axes
        )

    def dequantize(self, packed: jax.Array, scale: jax.Array, shifts: bool = False) -> jax.Array:
        """``shifts``: unpacked by shifts and masks (``unpack_int4``), the same values."""
        return dense_experts(
            ExpertFormat("int4", group=self.group), packed, scale, self.dtype, shifts
        )


class Fp8Experts(ExpertWeights):
    """e4m3 weight [E, out, in] and fp32 scale_inv [E, ceil(out/block), ceil(in/block)], dequantized
    like DeepSeek's fp8_cast_bf16 (fp32 product stored as bf16) and then cast to the model dtype."""

    PIECES = ("weight", "scale_inv")

    def __init__(
        self, shape: tuple[int, int, int], dtype: jnp.dtype, axes: tuple[str, str, str], block: int
    ):
        e, n_in, n_out = shape
        self.dtype = dtype
        self.block = block
        self.shape = (e, n_out, n_in)
        self.axes = (axes[0], axes[2], axes[1])
        self.units = (1, block, block)
        self.weight = nnx.Param(jnp.zeros(self.shape, jnp.float8_e4m3fn), logical_axes=self.axes)
        blocks = (e, -(-n_out // block), -(-n_in // block))
        self.scale_inv = nnx.Param(jnp.ones(blocks, jnp.float32), logical_axes=self.axes)

    def dequantize(self, weight: jax.Array, scale_inv: jax.Array) -> jax.Array:
        return dense_experts(ExpertFormat("fp8", block=self.block), weight, scale_inv, self.dtype)


def dense_experts(
    fmt: ExpertFormat, weight: jax.Array, scale: jax.Array, dtype: jnp.dtype, shifts: bool = False
) -> jax.Array:
    """Stored quantized experts [E, out, ...] (INT4 packed + scale, or FP8 +
    scale_inv) -> [E, in, out] in ``dtype``, rounded through bf16 like the
    formats' reference dequantizations (``shifts``: INT4 unpacked by shifts)."""
    if fmt.kind == "int4":
        dense = dequantize_int4_groups(
            weight, scale, scale.shape[-1] * fmt.group, scale.dtype, fmt.group, shifts
        )
    else:
        dense = dequantize_fp8_blocks(weight, scale, jnp.bfloat16, fmt.block)
    return dense.astype(dtype).swapaxes(-1, -2)


def expert_weights(
    fmt: ExpertFormat,
    rngs: nnx.Rngs,
    shape: tuple[int, int, int],
    dtype: jnp.dtype,
    axes: tuple[str, str, str],
) -> ExpertWeights:
    """One projection's stacked expert weights; calling it gives [E, in, out] in ``dtype``."""
    if fmt.kind == "dense":
        return DenseExperts(rngs, shape, dtype, axes)
    if fmt.kind == "int4":
        return Int4Experts(shape, dtype, axes, fmt.group)
    if fmt.kind == "fp8":
        return Fp8Experts(shape, dtype, axes, fmt.block)
    raise ValueError(f"expert format: expected 'dense', 'int4' or 'fp8', got {fmt.kind!r}")
