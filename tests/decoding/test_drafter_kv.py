"""The drafter's context K/V in 8-bit floats (``drafter_kv="fp8"``): half the bytes per context
token, the tokens still the target's, the trained drafter's drafts as often accepted."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

import jaxdd
from jaxdd.cli import DEMO
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.decoding.rows import RowPool
from jaxdd.errors import InputError
from jaxdd.generate import DEFAULT_PROMPT
from jaxdd.runtime.backend import Backend
from jaxdd.weights.tokenizer import load_tokenizer

ROUNDS = {"dflash": {}, "ddtree": {"budget": 16}}


@pytest.fixture(scope="module")
def pair():
    target = jaxdd.load_target(DEMO / "target", dtype="float32")
    return target, jaxdd.load_drafter(DEMO / "drafter", dtype="float32")


@pytest.mark.slow
def test_fp8_drafter_kv_gives_the_target_tokens_and_keeps_the_acceptance(pair):
    """The demo pair in fp32: DFlash and DDTree with the drafter's K/V in fp8 give plain greedy
    decoding's tokens; its drafts are accepted as often as with fp32 K/V (within 10%)."""
    prompt = load_tokenizer(DEMO / "target").encode(DEFAULT_PROMPT)
    common = {"max_new_tokens": 48, "stop_token_ids": []}
    exact = SpeculativeDecoder(*pair)
    greedy = exact.generate(prompt, method="ar", **common).tokens
    fp8 = SpeculativeDecoder(*pair, drafter_kv="fp8")
    state = fp8.admitted([prompt], max_new_tokens=8).state
    assert state.draft_cache.keys[0].dtype == jnp.float8_e4m3fn
    assert state.target_cache.latent[0].dtype == jnp.float32  # the verify's cache is untouched
    serving = RowPool.serving(fp8, method="dflash", rows=2, max_len=128)  # the server's pool
    assert serving.state.draft_cache.keys[0].dtype == jnp.float8_e4m3fn
    for method, options in ROUNDS.items():
        stored = exact.generate(prompt, method=method, **common, **options)
        rounded = fp8.generate(prompt, method=method, **common, **options)
        assert rounded.tokens == stored.tokens == greedy, method
        assert rounded.mean_acceptance > 0.9 * stored.mean_acceptance > 1.5, method


def test_an_unknown_drafter_kv_names_the_field(pair):
    with pytest.raises(InputError, match="drafter_kv: expected one of model, fp8"):
        SpeculativeDecoder(*pair, drafter_kv="int4")


@dataclasses.dataclass(frozen=True)
class Gpu:
    """What ``Backend.of_devices`` reads of a GPU."""

    compute_capability: str
    id: int = 0
    platform: str = "gpu"


def test_fp8_in_the_kernel_needs_a_gpu_whose_triton_loads_it(pair):
    """Triton loads e4m3 from compute capability 8.9 on: an A100 (8.0) refuses the kernel over
    fp8 K/V in one line, and takes them in XLA's form."""
    assert Backend.of_devices([Gpu("9.0"), Gpu("12.0", 1)]).fp8_kernels
    a100 = Backend.of_devices([Gpu("8.0")])
    assert not a100.fp8_kernels
    with pytest.raises(InputError, match="drafter_kv: fp8 K/V in the tree-attention kernel"):
        SpeculativeDecoder(*pair, attention="pallas", backend=a100, drafter_kv="fp8")
    assert SpeculativeDecoder(*pair, "absorbed", a100, drafter_kv="fp8").drafter_kv == "fp8"
