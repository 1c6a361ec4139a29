"""Input errors carry the field at fault beside their message, so a
caller (the server's ``param``) never reads it back out of the text."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxdd.config import KimiConfig
from jaxdd.decoding.checks import check_lengths, check_stop_ids, check_tokens, per_request
from jaxdd.decoding.sampling import Sampling
from jaxdd.errors import CheckpointError, ConfigError, FieldError, InputError


def test_at_names_the_field_and_starts_the_message_with_it():
    error = InputError.at("top_p", "must be in (0, 1], got 2")
    assert (error.field, str(error)) == ("top_p", "top_p: must be in (0, 1], got 2")
    assert InputError("no field here").field is None
    assert all(issubclass(kind, FieldError) for kind in (InputError, ConfigError, CheckpointError))


@pytest.mark.parametrize(
    ("check", "field"),
    [
        (lambda config: check_tokens([[1, -3]], config.vocab_size), "token_ids"),
        (lambda config: check_stop_ids(list(range(17)), config), "stop_token_ids"),
        (
            lambda config: check_lengths([np.ones(3)], [config.max_position_embeddings], config),
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
