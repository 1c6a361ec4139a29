"""A request's streamed text (``jaxdd.serve.output.Output``): the released pieces, stop strings and
stop ids, against the whole output decoded token by token, with a tokenizer of a token per byte."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxdd.serve.output import Output
from jaxdd.testing.byte_tokenizer import PerByteFallback
from jaxdd.testing.profiles import examples

TOKENIZER = PerByteFallback()
STOP_ID = 0  # NUL: a stop id, never spelled


def released(ids: list[int], stops: list[str], cuts: list[int]) -> tuple[str, Output]:
    """All the text an Output releases for ``ids`` arriving
    in chunks cut at ``cuts`` (the last chunk final)."""
    output = Output(TOKENIZER, {STOP_ID}, stops)
    edges = [0, *sorted(c % (len(ids) + 1) for c in cuts), len(ids)]
    chunks = list(itertools.pairwise(edges))
    text = "".join(
        output.add(ids[a:b], final=n == len(chunks) - 1) for n, (a, b) in enumerate(chunks)
    )
    return text, output


def token_by_token(ids: list[int], stops: list[str]) -> tuple[str, list[int]]:
    """(text, ids) by decoding the whole output after each token: it ends at the first
    token whose text holds a stop string, before the stop string that completed first."""
    for k in range(1, len(ids) + 1):
        text = TOKENIZER.decode([t for t in ids[:k] if t != STOP_ID])
        ends = [(text.find(s) + len(s), -len(s)) for s in stops if s in text]
        if ends:
            end, minus_length = min(ends)
            return text[: end + minus_length], ids[:k]
    return TOKENIZER.decode([t for t in ids if t != STOP_ID]), ids


ASCII = st.lists(st.sampled_from([STOP_ID, *b"abc d"]), max_size=40)
STOPS = st.lists(st.text("abc d", min_size=1, max_size=4), max_size=3)
CUTS = st.lists(st.integers(0, 40), max_size=10)


@settings(max_examples=examples(300), deadline=None)
@given(ASCII, STOPS, CUTS)
def test_stops_as_if_decoded_token_by_token(ids, stops, cuts):
    """However the tokens arrive, the text and ids are those
    of the token-by-token decode (stop ids unspelled)."""
    text, output = released(ids, stops, cuts)
    expected_text, expected_ids = token_by_token(ids, stops)
    assert (text, output.token_ids) == (expected_text, expected_ids)
    assert output.stopped == (
        len(expected_ids) < len(ids) or any(s in TOKENIZER.decode(ids) for s in stops)
    )


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.integers(0, 255), max_size=40), STOPS, CUTS)
def test_text_is_never_revised(ids, stops, cuts):
    """Any bytes, cut characters included: the released text is a prefix of the whole decode;
    when a stop string ended the output, one follows it there; else it is all of it."""
    text, output = released(ids, stops, cuts)
    whole = TOKENIZER.decode([t for t in ids if t != STOP_ID])
    assert whole.startswith(text)
    if output.stopped:
        assert any(whole[len(text) :].startswith(s) for s in stops)
    else:
        assert text == whole


def test_the_first_stop_string_to_complete_wins():
    """Stops "abcd" and "c", "ab" then "cd" in one chunk:
    "c" completed first (vLLM checks token by token)."""
    text, output = released(list(b"abcd"), ["abcd", "c"], [2])
    assert (text, output.token_ids) == ("ab", list(b"abc"))


def test_a_possible_stop_string_is_held_back_until_it_cannot_be():
    output = Output(TOKENIZER, set(), ["xyz"])
    assert output.add(list(b"abx"), final=False) == "ab"
    assert output.add(list(b"y"), final=False) == ""
    assert output.add(list(b"q"), final=False) == "xyq"
    assert output.add(list(b"xy"), final=True) == "xy"
