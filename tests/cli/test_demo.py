"""The bundled kimi-mini pair: small enough to ship, loads in transformers
and dflash, and jaxdd decodes it exactly as the PyTorch references do."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoTokenizer

import jaxdd
from jaxdd.cli import DEMO
from jaxdd.crosscheck.torch_reference import (
    Generation,
    dflash_reference,
    load_reference_models,
)
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.generate import DEFAULT_PROMPT, build_parser, read_prompt
from jaxdd.testing.reference import hf_greedy
from jaxdd.train.tokenizer import tokenizer_config
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


@pytest.mark.slow
@torch.inference_mode()
def test_jaxdd_decodes_the_bundled_pair_like_transformers_and_dflash(prompt):
    # transformers and dflash load it
    target, drafter = load_reference_models(DEMO / "target", DEMO / "drafter")
    greedy = hf_greedy(target, prompt, NEW_TOKENS)
    reference_tokens, reference_acceptance = dflash_reference(
        drafter, target, prompt, Generation(NEW_TOKENS, 8, [])
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


def test_bundled_tokenizer_is_what_hf_users_expect():
    """tokenizer_config.json as the trainer writes it: transformers' AutoTokenizer finds BOS / EOS
    and renders the chat template as jaxdd does; generate keeps the base model's prompts raw."""
    directory = DEMO / "target"
    saved = json.loads((directory / "tokenizer_config.json").read_text())
    backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
    longest = json.loads((directory / "config.json").read_text())["max_position_embeddings"]
    assert saved == tokenizer_config(backend, longest)
    hf = AutoTokenizer.from_pretrained(directory)
    assert (hf.bos_token, hf.eos_token, hf.eos_token_id) == ("<|endoftext|>",) * 2 + (0,)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "Now 4?"},
    ]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    turns = "system: Be brief.\nuser: Add 2 and 3.\nassistant: 5<|endoftext|>\nuser: Now 4?\n"
    assert text == turns + "assistant:"
    tokenizer = load_tokenizer(directory)
    assert tokenizer.chat_prompt("Add 2 and 3.", system="Be brief.") == hf.apply_chat_template(
        messages[:2], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    parser = build_parser()
    raw = read_prompt(parser.parse_args(["x = 1"]), tokenizer, True, parser)
    assert raw == (tokenizer.encode("x = 1"), "x = 1")
    chat = read_prompt(parser.parse_args(["x = 1", "--chat"]), tokenizer, True, parser)
    assert chat[0] == tokenizer.chat_prompt("x = 1")
