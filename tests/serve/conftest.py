"""What the server tests compare with (each request decoded alone, in this process), and a small
row pool for the in-process tests of the HTTP side."""

import pytest

import jaxdd
from jaxdd.cli import DEMO
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.decoding.rows import RowPool
from jaxdd.weights.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def reference():
    """(run, tokenizer): ``run(prompt, max_tokens, temperature, seed, top_p,
    method)`` decodes one request alone by SpeculativeDecoder.generate (its
    own cache size and batch of one), stopping where the server stops."""
    target, drafter = jaxdd.load_pair(DEMO / "target", DEMO / "drafter", "float32")
    decoder = SpeculativeDecoder(target, drafter)
    tokenizer = load_tokenizer(DEMO / "target")
    stops = sorted(set(target.config.eos_token_ids) | set(tokenizer.stop_ids))

    def run(
        prompt: list[int], max_tokens: int, temperature=0.0, seed=0, top_p=1.0, method="dflash"
    ) -> list[int]:
        sampling = jaxdd.Sampling(temperature, top_p, 0, seed)
        options = {
            "max_new_tokens": max_tokens,
            "stop_token_ids": stops,
            "sampling": sampling,
            "method": method,
        }
        return decoder.generate(prompt, **options).tokens

    return run, tokenizer


@pytest.fixture(scope="module")
def pool():
    """A two-row pool on the demo pair for the HTTP side in-process (nothing compiles unless it
    runs), up to 5 top logprobs."""
    target, drafter = jaxdd.load_pair(DEMO / "target", DEMO / "drafter", "float32")
    decoder = SpeculativeDecoder(target, drafter)
    return RowPool.serving(
        decoder, method="dflash", rows=2, max_len=64, max_prompt=32, max_logprobs=5
    )
