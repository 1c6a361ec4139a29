"""Input errors carry the field at fault beside their message, so a
caller (the server's ``param``) never reads it back out of the text."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from jaxdd.config import KimiConfig
from jaxdd.decoding.checks import Words, check_request, check_tokens, per_request
from jaxdd.decoding.engine import API_WORDS
from jaxdd.decoding.requests import RowRequest
from jaxdd.decoding.sampling import Sampling
from jaxdd.errors import CheckpointError, ConfigError, FieldError, InputError, RequestRefused


def pool_of(max_prompt: int, max_len: int):
    """What ``check_request`` reads of a pool's shape: its lengths and top logprobs."""
    return SimpleNamespace(
        max_prompt=max_prompt, max_len=max_len, spec=SimpleNamespace(top_logprobs=0)
    )


def check_api(config, request: RowRequest):
    """``request`` checked as ``generate_batch`` does, in a pool as long as the model's
    positions."""
    shape = pool_of(8, config.max_position_embeddings)
    return check_request(request, shape, config, API_WORDS)


def test_at_names_the_field_and_starts_the_message_with_it():
    error = InputError.at("top_p", "must be in (0, 1], got 2")
    assert (error.field, str(error)) == ("top_p", "top_p: must be in (0, 1], got 2")
    assert InputError("no field here").field is None
    assert all(issubclass(kind, FieldError) for kind in (InputError, ConfigError, CheckpointError))


@pytest.mark.parametrize(
    ("check", "field"),
    [
        (lambda config: check_tokens([[1, -3]], config.vocab_size), "token_ids"),
        (lambda config: check_api(config, RowRequest([1], 1, list(range(17)))), "stop_token_ids"),
        (
            lambda config: check_api(
                config, RowRequest([1] * 3, config.max_position_embeddings, [])
            ),
            "max_new_tokens",
        ),
        (lambda config: per_request("sampling", [1, 2], 3), "sampling"),
        (lambda config: Sampling(temperature=-1.0), "temperature"),
    ],
)
def test_the_checks_name_their_field(check, field):
    config = KimiConfig.from_json_file(
        Path(__file__).parent / "fixtures" / "kimi_k2_instruct_config.json"
    )
    with pytest.raises(InputError) as caught:
        check(config)
    assert caught.value.field == field
    assert field in str(caught.value)


def test_a_refusal_says_why_in_its_callers_words():
    """One check for every caller: the field and limit in the words it passes, the reason with the
    error (nothing works it out again), the caller's own stop ids counted with the request's."""
    config = KimiConfig.from_json_file(
        Path(__file__).parent / "fixtures" / "kimi_k2_instruct_config.json"
    )
    words = Words(max_new_tokens="max_tokens", max_len="--max-len", stop_ids="stop")
    with pytest.raises(RequestRefused) as caught:
        check_request(RowRequest([1, 2], 9, []), pool_of(4, 10), config, words)
    error = caught.value
    assert (error.field, error.reason) == ("max_tokens", "too_long")
    assert str(error) == "max_tokens: 9 after a prompt of 2 tokens exceeds --max-len 10"
    with pytest.raises(RequestRefused) as caught:
        check_request(RowRequest([1] * 5, 1, []), pool_of(4, 10), config, words)
    assert (caught.value.field, caught.value.reason) == ("prompt", "too_long")
    with pytest.raises(RequestRefused) as caught:
        check_request(RowRequest([1], 1, [20, 21]), pool_of(4, 10), config, words, tuple(range(15)))
    assert (caught.value.field, caught.value.reason) == ("stop", "invalid")
    assert str(caught.value) == "stop: at most 1 beside this model's 15 own, got 2"
    checked = check_request(RowRequest([1], 1, [20, 3]), pool_of(4, 10), config, words, (3, 0))
    assert checked.stop_ids == [0, 3, 20]
