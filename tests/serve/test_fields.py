"""Every field of OpenAI's completions and chat request bodies (as the installed ``openai`` package
types them) works or, with a value other than its default, is a 400 naming it; an explicit null is
the default. In-process on the HTTP side alone: the scheduler's thread never starts, so a request
that passes every check is answered 503 "compiling" at the queue."""

from __future__ import annotations

import json
import typing
from operator import itemgetter

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from starlette.testclient import TestClient

from jaxdd.cli import DEMO
from jaxdd.serve import protocol
from jaxdd.serve.app import Server, create_app
from jaxdd.serve.metrics import Metrics
from jaxdd.serve.scheduler import Scheduler
from jaxdd.weights.tokenizer import load_tokenizer

BASES = {
    "/v1/completions": {"prompt": [1, 2], "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}
MODELS = {
    "/v1/completions": protocol.CompletionRequest,
    "/v1/chat/completions": protocol.ChatRequest,
}
OPENAI = {
    "/v1/completions": completion_create_params.CompletionCreateParamsStreaming,
    "/v1/chat/completions": chat_create_params.CompletionCreateParamsStreaming,
}
SHARED_WORKS = {
    "model": "kimi-mini",
    "max_tokens": 3,
    "max_completion_tokens": 3,
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "seed": 7,
    "stop": ["\n", 5],
    "stop_token_ids": [5],
    "stream": True,
    "stream_options": {"include_usage": True, "include_obfuscation": False},
    "return_token_ids": True,
    "timeout": 5.0,
    "user": "someone",
    "n": 2,
}
# a value other than the default for each field the server serves
WORKS = {
    "/v1/completions": {
        **SHARED_WORKS,
        "prompt": "def f(x):",
        "best_of": 1,
        "logprobs": 2,
        "echo": True,
    },
    "/v1/chat/completions": {
        **SHARED_WORKS,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "metadata": {"run": "1"},
        "prompt_cache_key": "k",
        "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
        "prompt_cache_retention": "24h",
        "safety_identifier": "someone",
        "service_tier": "default",
        "logprobs": True,
        "top_logprobs": 2,
    },
}
# what a served field needs beside it
ALONGSIDE = {"top_logprobs": {"logprobs": True}}
SHARED_REFUSED = {
    "frequency_penalty": 0.5,
    "presence_penalty": -0.5,
    "logit_bias": {"5": 10},
    "min_tokens": 2,
    "ignore_eos": True,
    "repetition_penalty": 1.2,
    "min_p": 0.1,
    "use_beam_search": True,
    "length_penalty": 0.5,
    "include_stop_str_in_output": True,
    "prompt_logprobs": 1,
    "truncate_prompt_tokens": 4,
    "bad_words": ["x"],
    "allowed_token_ids": [5, 6],
    "logits_processors": ["module.Class"],
    "structured_outputs": {"regex": "a+"},
    "guided_json": {"type": "object"},
    "guided_regex": "a+",
    "guided_choice": ["a", "b"],
    "guided_grammar": "root ::= 'a'",
}
# a value other than the default for each field the server refuses
REFUSED = {
    "/v1/completions": {
        **SHARED_REFUSED,
        "best_of": 3,
        "suffix": "}",
    },
    "/v1/chat/completions": {
        **SHARED_REFUSED,
        "audio": {"voice": "alloy", "format": "mp3"},
        "modalities": ["text", "audio"],
        "function_call": "auto",
        "functions": [{"name": "f"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "prediction": {"type": "content", "content": "x"},
        "reasoning_effort": "low",
        "response_format": {"type": "json_object"},
        "store": True,
        "moderation": {"model": "omni-moderation-latest"},
        "service_tier": "flex",
        "verbosity": "low",
        "web_search_options": {},
        "echo": True,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "chat_template": "{{ messages }}",
        "chat_template_kwargs": {"thinking": True},
    },
}
PATHS = list(BASES)
CASES = [(path, field) for path in PATHS for field in REFUSED[path]]


@pytest.fixture(scope="module")
def client(pool):
    """The HTTP side of a server on the demo pair (chat by its own template) whose scheduler
    never becomes ready."""
    scheduler = Scheduler(pool, Metrics(pool.shape.spec.block), max_waiting=1)
    tokenizer = load_tokenizer(DEMO / "target")
    template = tokenizer.chat_template
    server = Server(scheduler, tokenizer, "kimi-mini", [0], template, None)
    return TestClient(create_app(server))


def passes_every_check(response) -> bool:
    return response.status_code == 503 and "compiling" in response.json()["error"]["message"]


@pytest.mark.parametrize("path", PATHS)
def test_every_openai_field_is_served_or_refused(path):
    """The installed openai package's fields, each among those served or refused; each of those
    a field of the request model (not an unknown field, ignored)."""
    fields = set(typing.get_type_hints(OPENAI[path]))
    tested = set(WORKS[path]) | set(REFUSED[path])
    assert fields - tested == set()
    assert tested - set(MODELS[path].model_fields) == set()
    assert set(MODELS[path].model_fields) - tested == set()  # and every declared field tested


@pytest.mark.parametrize("path", PATHS)
def test_served_fields_pass_every_check(client, path):
    for field, value in WORKS[path].items():
        response = client.post(path, json={**BASES[path], **ALONGSIDE.get(field, {}), field: value})
        assert passes_every_check(response), (field, response.text)


@pytest.mark.parametrize(("path", "field"), CASES)
def test_a_refused_field_is_named(client, path, field):
    response = client.post(path, json={**BASES[path], field: REFUSED[path][field]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{field}:")


@pytest.mark.parametrize("path", PATHS)
def test_null_is_the_default(client, path):
    """Each optional field's null parses as if it were left out, and is served."""
    model = MODELS[path]
    optional = [name for name, field in model.model_fields.items() if not field.is_required()]
    nulls = dict.fromkeys(optional, None)
    base = {key: value for key, value in BASES[path].items() if key not in optional}
    assert model.model_validate({**base, **nulls}) == model.model_validate(base)
    assert passes_every_check(client.post(path, json={**base, **nulls}))
    options = {"include_usage": None, "include_obfuscation": None}
    assert protocol.StreamOptions.model_validate(options) == protocol.StreamOptions()


def test_max_completion_tokens_limits_a_completion(client):
    """OpenAI's newer name is the limit on /v1/completions too: past --max-len it is refused."""
    body = {"prompt": [1, 2], "max_completion_tokens": 10**6}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400 and "--max-len" in response.json()["error"]["message"]
    parsed = protocol.CompletionRequest.model_validate({"prompt": [1], "max_completion_tokens": 4})
    assert parsed.max_new_tokens == 4


@pytest.mark.parametrize(
    "prompt", ["def f(x):", [5, 6], ["def f(x):", "x = "], [[5, 6], [7]]], ids=str
)
def test_each_prompt_form_is_served(client, prompt):
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert passes_every_check(response), response.text


def test_token_prompts_are_decoded_only_to_echo(pool, monkeypatch):
    tokenizer = load_tokenizer(DEMO / "target")
    decoded = []
    monkeypatch.setattr(tokenizer, "decode", lambda ids: decoded.append(list(ids)) or "")
    scheduler = Scheduler(pool, Metrics(pool.shape.spec.block), max_waiting=1)
    client = TestClient(create_app(Server(scheduler, tokenizer, "kimi-mini", [0], None, None)))
    body = {"prompt": [[5, 6], [7]], "max_tokens": 2}
    assert passes_every_check(client.post("/v1/completions", json=body))
    assert decoded == []
    assert passes_every_check(client.post("/v1/completions", json={**body, "echo": True}))
    assert decoded == [[5, 6], [7]]
    outside = {"prompt": [[5], [4096]], "echo": True, "max_tokens": 2}
    assert client.post("/v1/completions", json=outside).status_code == 400
    assert decoded == [[5, 6], [7]]  # a prompt is decoded once its ids are checked


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompt", ["def f(x):", [[5, 6, 7], [40, 41]]], ids=str)
def test_echo_of_no_token_without_logprobs_needs_no_rows(pool, client, prompt, stream):
    """Nothing to compute: answered by a server whose scheduler is ready but whose decode thread
    never runs (so not by the rows); refused like any request while it is not ready."""
    tokenizer = load_tokenizer(DEMO / "target")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    n = 2 // len(prompts)  # rows within --max-batch 2
    body = {"prompt": prompt, "echo": True, "max_tokens": 0, "n": n, "stream": stream}
    body["stream_options"] = {"include_usage": True} if stream else None
    compiling = client.post("/v1/completions", json=body)
    assert compiling.status_code == 503 and compiling.json()["error"]["code"] == "not_ready"
    scheduler = Scheduler(pool, Metrics(pool.shape.spec.block), max_waiting=1)
    scheduler.ready.set()
    server = Server(scheduler, tokenizer, "kimi-mini", [0], None, None)
    response = TestClient(create_app(server)).post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line[6:7] == "{"]
        choices = sorted((c for chunk in chunks for c in chunk["choices"]), key=itemgetter("index"))
        usage = chunks[-1]["usage"]
    else:
        choices, usage = response.json()["choices"], response.json()["usage"]
    texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]
    assert [c["text"] for c in choices] == [text for text in texts for _ in range(n)]
    assert {c["finish_reason"] for c in choices} == {"length"}
    assert all(c["logprobs"] is None for c in choices)
    tokens = sum(len(tokenizer.encode(p) if isinstance(p, str) else p) for p in prompts)
    assert usage == {
        "prompt_tokens": tokens,
        "completion_tokens": 0,
        "total_tokens": tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


@pytest.mark.parametrize(
    ("body", "words"),
    [({"prompt": [[5], [4096]]}, "vocabulary"), ({"prompt": [5] * 65}, "more than --max-len 64")],
)
def test_an_echo_needing_no_rows_is_checked(client, body, words):
    response = client.post("/v1/completions", json={**body, "echo": True, "max_tokens": 0})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "prompt" and words in error["message"]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": [[5, 6], []]}, "prompt", "prompt.1: List should have at least 1 item"),
        ({"prompt": ["x", ""]}, "prompt", "prompt.1: String should have at least 1 character"),
        ({"prompt": ["x", 5]}, "prompt", "valid string"),
        ({"prompt": [[5], [4096]]}, "prompt", "vocabulary"),
        ({"prompt": [[5]] * 4}, "prompt", "4 rows, more than this server holds (3"),
        ({"prompt": [[5]] * 2, "n": 2}, "prompt", "4 rows"),
        ({"prompt": [5], "n": 3}, "n", "n: at most --max-batch 2"),
        ({"prompt": [5], "n": 0}, "n", "greater than or equal to 1"),
        ({"prompt": [5], "n": 2, "best_of": 3}, "best_of", "best_of == n (2)"),
        ({"prompt": [5], "logprobs": 6}, "logprobs", "logprobs: at most --max-logprobs 5, got 6"),
        ({"prompt": [5], "logprobs": -1}, "logprobs", "greater than or equal to 0"),
        ({"prompt": [5], "max_tokens": 0}, "max_tokens", "max_tokens: 0 is served only with echo"),
    ],
)
def test_a_batch_past_the_server_is_refused(client, body, param, words):
    response = client.post("/v1/completions", json={"max_tokens": 2, **body})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and words in error["message"]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"top_logprobs": 2}, "top_logprobs", "top_logprobs: needs logprobs true"),
        ({"logprobs": True, "top_logprobs": 6}, "top_logprobs", "at most --max-logprobs 5, got 6"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens: 0 is served only with echo"),
    ],
)
def test_chat_logprobs_past_the_server_are_refused(client, body, param, words):
    messages = [{"role": "user", "content": "hi"}]
    response = client.post("/v1/chat/completions", json={"messages": messages, **body})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and words in error["message"]
