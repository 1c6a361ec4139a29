"""Logprobs and echo through the HTTP side in-process, its scheduler running on the demo pair: a
completion's and a chat's logprobs equal the decoder's for the same request, echo with max_tokens
0 scores a prompt (lm-eval's loglikelihood request) as the decoder's prompt logprobs, streamed
chunks carry what the whole response has, and nothing compiles after warm-up."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from starlette.testclient import TestClient

import jaxdd
from jaxdd.cli import DEMO, model_stop_ids
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.decoding.report import TokenLogprob
from jaxdd.decoding.rows import RowPool
from jaxdd.serve.app import Server, create_app
from jaxdd.serve.logprobs import ChoiceLogprobs
from jaxdd.serve.metrics import Metrics
from jaxdd.serve.scheduler import Scheduler
from jaxdd.weights.tokenizer import load_tokenizer

K = 5
PROMPTS = [[40, 41, 42, 43, 44], [300, 17, 9, 250, 33, 1000, 12]]
ATOL = 1e-5  # the same fp32 model, rounds of other shapes


@pytest.fixture(scope="module")
def served():
    """(client, decoder for references, tokenizer, stop ids, compiles after warm-up): a server
    of two rows, up to K top logprobs, its scheduler compiled and running."""
    target, drafter = jaxdd.load_pair(DEMO / "target", DEMO / "drafter", "float32")
    tokenizer = load_tokenizer(DEMO / "target")
    pool = RowPool.serving(
        SpeculativeDecoder(target, drafter),
        method="dflash",
        rows=2,
        max_len=64,
        max_prompt=32,
        max_logprobs=K,
    )
    scheduler = Scheduler(pool, Metrics(pool.shape.spec.block), max_waiting=8)
    stops = model_stop_ids(target.config, tokenizer)
    server = Server(scheduler, tokenizer, "kimi-mini", stops, tokenizer.chat_template, None)
    client = TestClient(create_app(server))
    scheduler.start()
    assert scheduler.ready.wait(900) and scheduler.failure is None
    try:
        yield client, SpeculativeDecoder(target, drafter), tokenizer, stops, compiles(client)
    finally:
        scheduler.stop()


def compiles(client: TestClient) -> float:
    text = client.get("/metrics").text
    return float(re.search(r"^jaxdd:compiles_total (\S+)$", text, re.MULTILINE).group(1))


def post(client: TestClient, path: str, body: dict) -> dict:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(client: TestClient, path: str, body: dict) -> list[dict]:
    """The chunks of a streamed request, the usage chunk and [DONE] left out."""
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [chunk for chunk in map(json.loads, lines[:-1]) if chunk["choices"]]


def generated(served, prompt: list[int], max_tokens: int, score: bool = False):
    """The decoder's generation of ``prompt`` alone, greedy, with top-K logprobs."""
    _, decoder, _, stops, _ = served
    return decoder.generate(
        prompt, max_new_tokens=max_tokens, stop_token_ids=stops, logprobs=K, score_prompt=score
    )


def check_completion(logprobs: dict, tokenizer, tokens: list[int], entries, k: int) -> None:
    """OpenAI's completion logprobs of ``tokens`` equal the decoder's ``entries`` (None: a
    prompt's first token): each top the token itself, then the top k, spelled."""
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in tokens]
    offsets = np.cumsum([0, *map(len, logprobs["tokens"][:-1])]).tolist()
    assert logprobs["text_offset"] == offsets
    for token, value, top, entry in zip(
        tokens, logprobs["token_logprobs"], logprobs["top_logprobs"], entries, strict=True
    ):
        if entry is None:
            assert value is None and top is None
            continue
        assert value == pytest.approx(entry.logprob, abs=ATOL)
        spelled = {tokenizer.decode([token]): entry.logprob}
        for other, logprob in entry.top[:k]:
            text = tokenizer.decode([other])
            spelled[text] = max(spelled.get(text, -np.inf), logprob)
        assert list(top) == list(spelled)
        np.testing.assert_allclose(list(top.values()), list(spelled.values()), atol=ATOL)


class Spelling:
    """A tokenizer that spells ids 1 and 2 alike and counts its decodes."""

    def __init__(self):
        self.decoded = []

    def decode(self, ids: list[int]) -> str:
        self.decoded.append(ids)
        return {1: "a", 2: "a"}.get(ids[0], str(ids[0]))


def test_spellings_are_memoized_and_alike_ones_keep_the_best():
    tokenizer = Spelling()
    entry = TokenLogprob(-3.0, [(2, -0.5), (7, -1.0), (1, -3.0)])
    for _ in range(2):  # two choices of a request
        part = ChoiceLogprobs(tokenizer, "completion").add([1, 1], [entry, entry])
        assert part["top_logprobs"] == [{"a": -0.5, "7": -1.0}] * 2
    assert sorted(tokenizer.decoded) == [[1], [2], [7]]  # each id decoded once


@pytest.mark.slow
def test_nothing_compiles_while_serving_logprobs(served):
    """First in the module: every kind of logprobs request runs on what warm-up compiled."""
    client, *_, after_warm_up = served
    assert compiles(client) == after_warm_up > 0
    for body in (
        {"prompt": PROMPTS[0], "max_tokens": 6, "logprobs": 2},
        {"prompt": PROMPTS, "max_tokens": 0, "echo": True, "logprobs": 1},
        {"prompt": [5] * 30, "max_tokens": 3, "echo": True, "logprobs": K, "temperature": 0.7},
        {"prompt": "def f(x):", "max_tokens": 0, "echo": True},
        {"prompt": PROMPTS[1], "max_tokens": 4},
    ):
        post(client, "/v1/completions", body)
    messages = [{"role": "user", "content": "hi"}]
    post(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "logprobs": True})
    streamed(client, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 5, "logprobs": 1})
    assert compiles(client) == after_warm_up


def test_completion_logprobs_equal_the_decoders(served):
    client, _, tokenizer, _, _ = served
    body = {"prompt": PROMPTS[1], "max_tokens": 12, "logprobs": 3, "return_token_ids": True}
    choice = post(client, "/v1/completions", {**body, "temperature": 0})["choices"][0]
    expected = generated(served, PROMPTS[1], 12)
    assert choice["token_ids"] == expected.tokens
    check_completion(choice["logprobs"], tokenizer, expected.tokens, expected.logprobs, 3)
    plain = post(client, "/v1/completions", {**body, "logprobs": None, "temperature": 0})
    assert plain["choices"][0]["logprobs"] is None
    assert plain["choices"][0]["token_ids"] == expected.tokens  # asking changed no token


def test_completion_top_logprobs_hold_the_token_itself(served):
    """OpenAI's "up to logprobs + 1": logprobs 0 gives each token's own, and a sampled token
    outside the top one is in its own top too."""
    client, *_ = served
    body = {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 2.0, "seed": 3}
    alone = post(client, "/v1/completions", {**body, "logprobs": 0})["choices"][0]["logprobs"]
    assert alone["top_logprobs"] == [
        {text: value} for text, value in zip(alone["tokens"], alone["token_logprobs"], strict=True)
    ]
    one = post(client, "/v1/completions", {**body, "logprobs": 1})["choices"][0]["logprobs"]
    assert one["tokens"] == alone["tokens"]  # asking for more changed no token
    triples = zip(one["tokens"], one["token_logprobs"], one["top_logprobs"], strict=True)
    for text, value, top in triples:
        assert next(iter(top)) == text and top[text] >= value and len(top) <= 2
    assert any(len(top) == 2 for top in one["top_logprobs"])  # sampled past the top one


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_scores_prompts_as_lm_eval_asks(served, max_tokens):
    """lm-eval's loglikelihood request: a batch of id lists, echo, logprobs 1, max_tokens 0 (or
    1, as lm-eval 0.4.13 sends): each choice the prompt's text then its continuation's, the
    prompt's tokens' logprobs (the first null) those of the decoder's scored prefill."""
    client, _, tokenizer, _, _ = served
    body = {"prompt": PROMPTS, "echo": True, "logprobs": 1, "max_tokens": max_tokens}
    response = post(client, "/v1/completions", {**body, "temperature": 0})
    for prompt, choice in zip(PROMPTS, response["choices"], strict=True):
        expected = generated(served, prompt, 1, score=True)
        tokens = prompt + expected.tokens[:max_tokens]
        assert choice["text"] == tokenizer.decode(tokens)
        assert choice["finish_reason"] == "length"
        entries = [None, *expected.prompt_logprobs, *expected.logprobs[:max_tokens]]
        check_completion(choice["logprobs"], tokenizer, tokens, entries, 1)
    assert response["usage"]["completion_tokens"] == max_tokens * len(PROMPTS)


def test_echo_offsets_count_the_spellings_of_cut_characters(served):
    """A prompt whose tokens cut UTF-8 characters (each piece spelled U+FFFD): every offset,
    the new tokens' too, counts the pieces' spellings, not the echoed text's characters."""
    client, _, tokenizer, _, _ = served
    prompt = tokenizer.encode('x = "é漢"')
    assert len(tokenizer.decode(prompt)) < sum(len(tokenizer.decode([t])) for t in prompt)
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0}
    logprobs = post(client, "/v1/completions", body)["choices"][0]["logprobs"]
    tokens = logprobs["tokens"]
    assert len(tokens) > len(prompt)
    assert logprobs["text_offset"] == np.cumsum([0, *map(len, tokens[:-1])]).tolist()


def test_echo_without_logprobs_and_of_a_text(served):
    client, *_ = served
    body = {"prompt": "def f(x):", "echo": True, "max_tokens": 4, "temperature": 0}
    choice = post(client, "/v1/completions", body)["choices"][0]
    alone = post(client, "/v1/completions", {**body, "echo": False})["choices"][0]
    assert choice["text"] == "def f(x):" + alone["text"] and choice["logprobs"] is None


def test_chat_logprobs_equal_the_decoders(served):
    client, _, tokenizer, _, _ = served
    messages = [{"role": "user", "content": "def add(a, b):"}]
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    choice = post(client, "/v1/chat/completions", {**body, "logprobs": True, "top_logprobs": 2})[
        "choices"
    ][0]
    expected = generated(served, tokenizer.chat_prompt("def add(a, b):"), 8)
    assert choice["token_ids"] == expected.tokens
    content = choice["logprobs"]["content"]
    assert len(content) == len(expected.tokens)
    for item, token, entry in zip(content, expected.tokens, expected.logprobs, strict=True):
        text = tokenizer.decode([token])
        assert item["token"] == text and item["bytes"] == list(text.encode())
        assert item["logprob"] == pytest.approx(entry.logprob, abs=ATOL)
        assert [t["token"] for t in item["top_logprobs"]] == [
            tokenizer.decode([t]) for t, _ in entry.top[:2]
        ]
    no_top = post(client, "/v1/chat/completions", {**body, "logprobs": True})["choices"][0]
    assert all(item["top_logprobs"] == [] for item in no_top["logprobs"]["content"])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_logprobs_join_to_the_whole(served, path):
    client, *_ = served
    if path == "/v1/completions":
        body = {"prompt": PROMPTS[0], "echo": True, "logprobs": 2}
    else:
        messages = [{"role": "user", "content": "import os"}]
        body = {"messages": messages, "logprobs": True, "top_logprobs": 2}
    body |= {"max_tokens": 12, "temperature": 0}
    whole = post(client, path, body)["choices"][0]["logprobs"]
    chunks = streamed(client, path, body)
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert len(parts) > 1
    joined = {key: [x for part in parts for x in part[key]] for key in whole}
    assert joined == whole
