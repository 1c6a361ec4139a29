"""Checkpoint tokenizers: Kimi's tiktoken.model +
tokenizer_config.json (synthetic), tokenizer.json, chat templates."""

from __future__ import annotations

import itertools
import json

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st
from tiktoken._educational import bpe_train
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jaxdd.cli import DEMO
from jaxdd.errors import CheckpointError
from jaxdd.testing.byte_tokenizer import PerByteFallback
from jaxdd.testing.kimi_tokenizer import KIMI_STYLE_TEMPLATE, SPECIAL, write_kimi_tokenizer
from jaxdd.testing.profiles import examples
from jaxdd.weights.tokenizer import (
    KIMI_PATTERN,
    IncrementalDecoder,
    KimiTokenizer,
    TextTokenizer,
    load_tokenizer,
)

TEXT = "def add(a, b):\n    return a + b\n\n# 加法 adds numbers; it's 123456 times faster\n" * 4


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kimi")
    ranks = bpe_train(TEXT, 300, r"\s?\w+|\s?[^\w\s]+|\s+", visualise=None)
    base = write_kimi_tokenizer(directory, ranks)
    return load_tokenizer(directory), base


def test_kimi_tiktoken_special_tokens(kimi):
    tokenizer, base = kimi
    assert isinstance(tokenizer, KimiTokenizer)
    assert [tokenizer.token_id(t) for t in SPECIAL] == list(range(base, base + len(SPECIAL)))
    # unnamed slots are reserved
    assert tokenizer.token_id(f"<|reserved_token_{base + 100}|>") == base + 100
    assert len(tokenizer.special) == 256
    assert tokenizer.stop_ids == [base + 1, base + 2]  # [EOS] and, as a chat model, <|im_end|>
    assert tokenizer.encode("<|im_end|>", special=True) == [base + 2]
    plain = tokenizer.encode("<|im_end|>")  # typed by a user: text, not the control token
    assert base + 2 not in plain and tokenizer.decode(plain) == "<|im_end|>"
    assert len(tokenizer.encode("return a + b")) < len(b"return a + b")  # the ranks' merges apply


@settings(max_examples=examples(60), deadline=None)
@given(
    st.text(alphabet=st.characters(codec="utf-8"), max_size=40) | st.sampled_from(TEXT.splitlines())
)
def test_kimi_encoding_follows_the_pattern_and_round_trips(kimi, text):
    """Each piece of Kimi's pre-tokenizer regex (run by the ``regex`` module, which spells ``&&``
    class intersection in V1 mode) is encoded on its own: merges never cross a piece boundary."""
    tokenizer, _ = kimi
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    pieces = regex.findall(KIMI_PATTERN, text, flags=regex.V1)
    assert "".join(pieces) == text
    assert ids == [i for piece in pieces for i in tokenizer.backend.encode_ordinary(piece)]


def test_han_characters_split_from_latin_letters(kimi):
    assert regex.findall(KIMI_PATTERN, "加法adds 加法", flags=regex.V1) == [
        "加法",
        "adds",
        " ",
        "加法",
    ]


def test_chat_template_renders_like_transformers(kimi, tmp_path):
    tokenizer, base = kimi
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "add 2 and 3"},
    ]
    backend = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    reference = PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=KIMI_STYLE_TEMPLATE)
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.chat_prompt("add 2 and 3", system="Be brief.")
    assert tokenizer.decode(ids) == expected
    assert ids == tokenizer.encode(expected, special=True)
    im = {t: tokenizer.token_id(t) for t in SPECIAL}
    assert ids[0] == im["<|im_system|>"] and ids[-1] == im["<|im_middle|>"]
    assert ids.count(im["<|im_end|>"]) == 2
    generation_prompt = [
        im["<|im_assistant|>"],
        *tokenizer.encode("assistant"),
        im["<|im_middle|>"],
    ]
    assert (
        ids[-len(generation_prompt) :] == generation_prompt and im["<|im_assistant|>"] == base + 4
    )


def test_chat_template_file_and_plain_tokenizers(tmp_path):
    ranks = {bytes([b]): b for b in range(256)}
    write_kimi_tokenizer(tmp_path / "file", ranks, template=None)
    assert load_tokenizer(tmp_path / "file").chat_template is None
    (tmp_path / "file" / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    tokenizer = load_tokenizer(tmp_path / "file")
    assert tokenizer.decode(tokenizer.chat_prompt("hi")) == "hi!"
    assert tokenizer.stop_ids == [257, 258]
    assert load_tokenizer(tmp_path) is None  # no tokenizer files at all


def test_bad_tokenizer_files_are_named(tmp_path):
    ranks = {bytes([b]): b for b in range(256)}
    write_kimi_tokenizer(tmp_path, ranks)
    with open(tmp_path / "tiktoken.model", "a") as f:
        f.write("not-base64!! 256\n")
    with pytest.raises(
        CheckpointError, match="tiktoken.model: line 257 is not 'base64-token rank'"
    ):
        load_tokenizer(tmp_path)
    write_kimi_tokenizer(tmp_path, ranks)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["9999"] = {"content": "<|far|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError,
        match=r"added token id\(s\) \[9999\] outside the special range \[256, 512\)",
    ):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{")
    with pytest.raises(CheckpointError, match="tokenizer_config.json: not valid JSON"):
        load_tokenizer(tmp_path)


DEMO_TOKENIZER = load_tokenizer(DEMO / "target")


def streamed(tokenizer: TextTokenizer, ids: list[int], cuts: list[int]) -> list[str]:
    """The pieces an ``IncrementalDecoder`` releases for
    ``ids`` given in chunks cut at ``cuts``, then closed."""
    decoder = IncrementalDecoder(tokenizer)
    edges = [0, *sorted(c % (len(ids) + 1) for c in cuts), len(ids)]
    pieces = [decoder.push(ids[a:b]) for a, b in itertools.pairwise(edges)]
    return [*pieces, decoder.push([], final=True)]


@settings(max_examples=examples(80), deadline=None)
@given(st.data())
@pytest.mark.parametrize("which", ["demo", "kimi", "per-byte"])
def test_incremental_decoding_releases_the_whole_text_in_order(kimi, which, data):
    """Random ids (any byte sequences, special tokens included) in random chunks: the released
    pieces add up to the whole decode, and no piece but the last ends mid-character."""
    tokenizer = {"demo": DEMO_TOKENIZER, "kimi": kimi[0], "per-byte": PerByteFallback()}[which]
    vocab = 256 if which == "per-byte" else max(tokenizer.special.values()) + 1
    ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=30))
    pieces = streamed(tokenizer, ids, data.draw(st.lists(st.integers(0, 30), max_size=8)))
    assert "".join(pieces) == tokenizer.decode(ids)
    assert not any(piece.endswith("\ufffd") for piece in pieces[:-1])


def test_a_character_cut_over_tokens_waits_for_its_last_byte():
    """Three byte tokens of 中, decoded per byte as two U+FFFD before the
    third: nothing is released until it comes, and the text goes on after it
    (holding back a single U+FFFD released one of those and then nothing)."""
    tokenizer = PerByteFallback()
    ids = tokenizer.encode("a中b")
    assert streamed(tokenizer, ids, [1, 2, 3, 4]) == ["a", "", "", "中", "b", ""]
