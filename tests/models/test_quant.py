"""FP8-block and INT4 pack-quantized dequantization, exactly equal to the references' own code."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize

from jaxdd.models.quant import dequantize_fp8_blocks, dequantize_int4_groups, unpack_int4
from jaxdd.testing.hf_layouts import deepseek_weight_dequant


@pytest.mark.parametrize("shape", [(576, 7168 // 8), (256, 384), (130, 200)])
def test_fp8_block_dequant_matches_deepseek(shape):
    """Partial edge blocks included (576 = 4.5 blocks, like kv_a_proj_with_mqa's [5, 56] scales)."""
    rng = np.random.default_rng(0)
    weight = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * 3).to(
        torch.float8_e4m3fn
    )
    blocks = (-(-shape[0] // 128), -(-shape[1] // 128))
    scale_inv = torch.from_numpy(rng.uniform(1e-3, 1e-1, blocks).astype(np.float32))
    expected = deepseek_weight_dequant(weight, scale_inv).float().numpy()
    ours = dequantize_fp8_blocks(
        jnp.asarray(weight.float().numpy()).astype(jnp.float8_e4m3fn), jnp.asarray(scale_inv)
    )
    np.testing.assert_array_equal(np.asarray(ours.astype(jnp.float32)), expected)


@pytest.mark.parametrize("shape", [(8, 64), (3, 2048), (5, 100)])
def test_int4_unpack_matches_compressed_tensors(shape):
    values = torch.from_numpy(np.random.default_rng(1).integers(-8, 8, shape).astype(np.int8))
    packed = pack_to_int32(values, 4)
    for shifts in (False, True):  # the bitcast and the shifts-and-masks unpacking (GPU, TPU)
        unpacked = unpack_int4(jnp.asarray(packed.numpy()), shape[1], shifts=shifts)
        np.testing.assert_array_equal(np.asarray(unpacked), values.numpy())
    np.testing.assert_array_equal(
        unpack_from_int32(packed, 4, torch.Size(shape)).numpy(), values.numpy()
    )


def test_int4_group_dequant_matches_compressed_tensors():
    """Kimi K2.5 routed-expert layout: weight_packed
    int32 [out, in/8], weight_scale bf16 [out, in/32]."""
    out_features, in_features = 64, 256
    rng = np.random.default_rng(2)
    values = torch.from_numpy(rng.integers(-8, 8, (out_features, in_features)).astype(np.int8))
    scale = torch.from_numpy(
        rng.uniform(1e-3, 2e-2, (out_features, in_features // 32)).astype(np.float32)
    )
    scale = scale.to(torch.bfloat16)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    expected = dequantize(values, scale, None, args=args, dtype=torch.bfloat16).float().numpy()
    packed = pack_to_int32(values, 4).numpy()
    ours = dequantize_int4_groups(
        jnp.asarray(packed), jnp.asarray(scale.float().numpy(), jnp.bfloat16), in_features
    )
    np.testing.assert_array_equal(np.asarray(ours.astype(jnp.float32)), expected)
    stacked = dequantize_int4_groups(
        jnp.asarray(packed)[None], jnp.asarray(scale.float().numpy())[None], in_features
    )
    assert stacked.shape == (1, out_features, in_features)  # stacked experts [E, out, in]
