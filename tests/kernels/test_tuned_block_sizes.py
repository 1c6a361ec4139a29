"""The kernels' tuning table: a named device gets its own tiles, an unknown one the fallback's."""

import jax.numpy as jnp
import pytest

from pallas_kernels.tuned_block_sizes import ANY, TUNED, block_sizes, dtype_class, gpu_device


def test_a_named_device_gets_its_tuned_entry():
    assert block_sizes("tree_attention", "rtx-pro-6000", "bf16")["block_k"] == 32
    assert block_sizes("tree_attention", "rtx-pro-6000", "fp32")["block_k"] == 16
    assert (
        block_sizes("tree_attention", "h200", "fp32") is TUNED[("tree_attention", "h200", "fp32")]
    )


def test_an_unknown_device_falls_back():
    for dtype in ("bf16", "fp32"):
        fallback = TUNED[("tree_attention", "h200", dtype)]
        assert block_sizes("tree_attention", "some-future-gpu", dtype) is fallback
    tpu = TUNED[("tree_attention_tpu", ANY, ANY)]
    assert block_sizes("tree_attention_tpu", "TPU v7", "bf16") is tpu


def test_an_unknown_kernel_is_an_error_naming_it():
    with pytest.raises(KeyError, match="no_such_kernel"):
        block_sizes("no_such_kernel")


def test_devices_and_dtypes_map_onto_the_table():
    assert gpu_device(None) == "h200"  # unknown shared memory: the H200 assumed
    assert gpu_device(227 * 1024) == "h200"
    assert gpu_device(99 * 1024) == "rtx-pro-6000"
    assert [dtype_class(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32)] == [
        "bf16",
        "bf16",
        "fp32",
    ]
