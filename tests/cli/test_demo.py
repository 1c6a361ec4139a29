"""The bundled kimi-mini pair: small enough to ship, loads in transformers
and dflash, and jaxdd decodes it exactly as the PyTorch references do."""

from __future__ import annotations

import pytest
import torch

import jaxdd
from jaxdd.cli import DEMO
from jaxdd.crosscheck.torch_reference import dflash_reference, load_reference_models
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.generate import DEFAULT_PROMPT
from jaxdd.testing.reference import hf_greedy
from jaxdd.weights.tokenizer import load_tokenizer

NEW_TOKENS = 24


def test_bundle_is_small_and_complete():
    files = [p for p in DEMO.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 50 * 2**20
    for part in ("target", "drafter"):
        names = {p.name for p in (DEMO / part).iterdir()}
        assert {"config.json", "model.safetensors.index.json"} <= names, part
    assert (DEMO / "target" / "tokenizer.json").is_file()


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return load_tokenizer(DEMO / "target").encode(DEFAULT_PROMPT)


@torch.inference_mode()
def test_jaxdd_decodes_the_bundled_pair_like_transformers_and_dflash(prompt):
    # transformers and dflash load it
    target, drafter = load_reference_models(DEMO / "target", DEMO / "drafter")
    greedy = hf_greedy(target, prompt, NEW_TOKENS)
    reference_tokens, reference_acceptance = dflash_reference(
        drafter, target, prompt, NEW_TOKENS, 8, []
    )
    assert reference_tokens == greedy  # the reference itself is lossless

    decoder = SpeculativeDecoder(
        jaxdd.load_target(DEMO / "target", dtype="float32"),
        jaxdd.load_drafter(DEMO / "drafter", dtype="float32"),
    )
    common = {"max_new_tokens": NEW_TOKENS, "stop_token_ids": []}
    linear = decoder.generate(prompt, method="dflash", **common)
    assert linear.tokens == greedy and linear.acceptance_lengths == reference_acceptance
    tree = decoder.generate(prompt, method="ddtree", budget=16, **common)
    assert tree.tokens == greedy
    assert linear.mean_acceptance > 1.5  # the drafter is trained: several tokens per target forward
