"""Test setup: CPU only, 8 simulated devices (set before JAX initialises its backends)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


import jax.numpy as jnp
import pytest

import jaxdd
from jaxdd.decoder import SpeculativeDecoder
from jaxdd.hf_weights import load_hf_drafter
from jaxdd.testing.reference import TINY_K2, TINY_K25, drafter_config, hf_drafter, hf_model


@pytest.fixture(scope="session", params=[0, 1], ids=["seed0", "seed1"])
def models(request, tmp_path_factory):
    """A tiny HF target + DFlash drafter pair, and the same weights loaded into jaxdd."""
    seed = request.param
    target_config = TINY_K2 if seed == 0 else TINY_K25
    ref_target = hf_model(target_config, seed)
    ref_drafter = hf_drafter(drafter_config(yarn=seed == 1), seed)
    root = tmp_path_factory.mktemp(f"pair{seed}")
    ref_target.save_pretrained(root / "target")
    ref_drafter.save_pretrained(root / "drafter")
    target = jaxdd.load_target(root / "target", dtype="float32")
    drafter = load_hf_drafter(root / "drafter", jnp.float32)
    return ref_target, ref_drafter, SpeculativeDecoder(target, drafter)
