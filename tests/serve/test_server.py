"""python -m jaxdd.serve on loopback with the bundled pair, driven by the real
``openai`` client: both endpoints, streamed and not, concurrent requests equal to their
runs alone (greedy and seeded), stop strings and ids, usage, token ids, cancellation,
the queue limit, bad requests, health, metrics, no compile after warm-up, prompt batches and n
seeded rows, max_completion_tokens and nulls, the API key and the access log."""

from __future__ import annotations

import concurrent.futures
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from jaxdd.testing.server import START_SECONDS, complete, running_server, wait_until

ROWS, WAITING, MAX_LEN, MAX_PROMPT = 4, 4, 512, 32
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
KEY = "test-key"


@pytest.fixture(scope="module")
def log(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serve_log") / "server.log"


@pytest.fixture(scope="module")
def server(tmp_path_factory, log):
    """(base url, openai client, the server's compiles right after warm-up), the server stopped by
    pid after; it wants the key KEY (from the environment), its model named by vLLM's flag."""
    template = tmp_path_factory.mktemp("serve") / "chat.jinja"
    template.write_text(TEMPLATE)
    args = ["--max-batch", str(ROWS), "--max-waiting", str(WAITING), "--max-len", str(MAX_LEN)]
    args += ["--max-prompt", str(MAX_PROMPT), "--chat-template", str(template)]
    args += ["--served-model-name", "kimi-mini"]
    args += ["--max-logprobs", "0"]  # rounds without top logprobs: no request here asks
    with running_server(args, log, env={"JAXDD_API_KEY": KEY}) as process:
        client = openai.OpenAI(base_url=f"{process.url}/v1", api_key=KEY, timeout=60, max_retries=0)
        yield process.url, client, process.metric("compiles_total")


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(rf"^jaxdd:{name} (\S+)$", text, re.MULTILINE)
    assert found, name
    return float(found.group(1))


def requests_for(seed: int, count: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        prompt = rng.integers(1, 4096, size=int(rng.integers(3, MAX_PROMPT))).tolist()
        sampled = i % 2 == 1
        out.append(
            {
                "prompt": prompt,
                "max_tokens": int(rng.integers(8, 48)),
                "temperature": 0.7 if sampled else 0.0,
                "top_p": 0.9 if sampled else 1.0,
                "seed": int(rng.integers(0, 2**31)),
                "stream": i % 3 == 0,
            }
        )
    return out


@pytest.mark.slow
def test_concurrent_requests_equal_their_runs_alone(server, reference):
    """Greedy and seeded sampled requests of mixed lengths, more than there are rows, sent at
    once (some streamed): each one's tokens are what it decodes alone; usage counts them."""
    _, client, _ = server
    run, _ = reference
    batch = requests_for(seed=1, count=ROWS + 2)
    with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
        results = list(pool.map(lambda r: complete(client, r), batch))
    for request, (ids, _, finish, usage) in zip(batch, results, strict=True):
        settings = [request[k] for k in ("prompt", "max_tokens", "temperature", "seed", "top_p")]
        expected = run(*settings)
        assert ids == expected, request
        assert finish == ("length" if len(ids) == request["max_tokens"] else "stop")
        assert usage == {
            "prompt_tokens": len(request["prompt"]),
            "completion_tokens": len(ids),
            "total_tokens": len(request["prompt"]) + len(ids),
            "prompt_tokens_details": {"cached_tokens": 0},  # prompts shorter than a page
        }


@pytest.mark.slow
def test_server_equals_the_cli(server):
    """A seeded sampled request gives what python -m jaxdd.generate --no-chat gives for it."""
    _, client, _ = server
    prompt = "def fibonacci(n):"
    argv = [
        sys.executable,
        "-m",
        "jaxdd.generate",
        prompt,
        "--no-chat",
        "--json",
        "--max-new-tokens",
        "24",
    ]
    argv += ["--temperature", "0.8", "--seed", "11", "--dtype", "float32"]
    cli = json.loads(
        subprocess.run(
            argv, capture_output=True, text=True, check=True, timeout=START_SECONDS
        ).stdout
    )
    ids, text, _, _ = complete(
        client, {"prompt": prompt, "max_tokens": 24, "temperature": 0.8, "seed": 11}
    )
    # no stop id among them: the texts agree too
    assert ids == cli["output_ids"] and text == cli["text"]


def test_chat_streamed_equals_chat_whole(server, reference):
    _, client, _ = server
    run, tokenizer = reference
    messages = [{"role": "user", "content": "Write a loop."}]
    whole = client.chat.completions.create(
        model="kimi-mini", messages=messages, max_tokens=20, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model="kimi-mini",
            messages=messages,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.role == "assistant" and text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    prompt = tokenizer.encode("<user>Write a loop.\n<assistant>", special=True)
    assert whole.usage.prompt_tokens == len(prompt)
    expected = run(prompt, 20)
    assert whole.usage.completion_tokens == len(expected)
    assert whole.choices[0].message.content == tokenizer.decode([t for t in expected if t != 0])


def test_stop_ids_and_stop_strings(server, reference):
    _, client, _ = server
    run, tokenizer = reference
    prompt = tokenizer.encode("class Stack:\n")
    full = run(prompt, 40)
    stop_id = full[6]
    ids, _, finish, _ = complete(
        client, {"prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": [stop_id]}
    )
    assert ids == full[: full.index(stop_id) + 1] and finish == "stop"
    text = tokenizer.decode(full)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    ids, cut, finish, _ = complete(
        client, {"prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": stop}
    )
    assert finish == "stop" and cut == text[: text.index(stop)]
    assert stop in tokenizer.decode(ids) and stop not in tokenizer.decode(ids[:-1])
    streamed = complete(
        client, {"prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": stop, "stream": True}
    )
    assert streamed[:3] == (ids, cut, "stop")


def test_closed_stream_frees_its_row(server):
    url, client, _ = server
    before = metric(url, "generation_tokens_total")
    max_tokens = MAX_LEN - 8
    stream = client.completions.create(
        model="kimi-mini",
        prompt=[5, 6, 7],
        max_tokens=max_tokens,
        temperature=1.0,
        seed=3,
        stream=True,
    )
    next(iter(stream))
    assert metric(url, "num_requests_running") == 1
    stream.close()
    deadline = time.monotonic() + 120  # a bound for a hung server only
    while metric(url, "num_requests_running") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(url, "num_requests_running") == 0
    # ended early, not run to its length
    assert metric(url, "generation_tokens_total") - before < max_tokens


def test_timeout_ends_a_request(server):
    _, client, _ = server
    response = client.completions.create(
        model="kimi-mini",
        prompt=[9, 8, 7],
        max_tokens=MAX_LEN - 8,
        temperature=1.0,
        extra_body={"timeout": 0.05},
    )
    assert response.choices[0].finish_reason == "timeout"
    assert response.usage.completion_tokens < MAX_LEN - 8


def test_health_models_metrics_and_no_compile_after_warm_up(server):
    url, client, compiles = server
    assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == ["kimi-mini"]
    for i, length in enumerate([3, MAX_PROMPT]):  # both prompt buckets, greedy and sampled
        complete(
            client, {"prompt": [7] * length, "max_tokens": 12, "temperature": 0.5 * i, "seed": i}
        )
    assert metric(url, "compiles_total") == compiles > 0
    assert metric(url, "spec_decode_num_drafts_total") > 0
    assert metric(url, "spec_decode_num_accepted_tokens_total") <= metric(
        url, "spec_decode_num_draft_tokens_total"
    )
    assert metric(url, "time_to_first_token_seconds_count") > 0
    assert metric(url, "acceptance_length_count") == metric(url, "spec_decode_num_drafts_total")
    assert metric(url, re.escape('rounds_total{spec="dflash-8"}')) > 0  # the one round it has
    assert metric(url, re.escape('round_choice{spec="dflash-8"}')) == 1


def test_max_completion_tokens_on_completions_and_null_as_default(server, reference):
    """OpenAI's newer name limits a completion too; nulls are the defaults (top_p 1, no stop)."""
    _, client, _ = server
    run, _ = reference
    prompt = [11, 12, 13]
    extra = {"max_completion_tokens": 5, "return_token_ids": True, "top_p": None, "stop": None}
    response = client.completions.create(
        model="kimi-mini", prompt=prompt, temperature=0, extra_body=extra
    )
    assert response.choices[0].token_ids == run(prompt, 5)


def test_a_key_is_wanted_and_each_request_logged(server, log):
    """Without the key a 401 (the openai client's AuthenticationError); /health and /metrics stay
    open; each request's access-log line has its status and tokens."""
    url, client, _ = server
    stranger = openai.OpenAI(base_url=f"{url}/v1", api_key="guess", timeout=60, max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
        stranger.completions.create(model="kimi-mini", prompt=[1, 2], max_tokens=2)
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert metric(url, 'request_refused_total{reason="unauthorized"}') == 1
    whole = client.completions.create(
        model="kimi-mini", prompt=[3, 4, 5], max_tokens=6, temperature=0
    ).usage.completion_tokens
    stream = client.completions.create(
        model="kimi-mini",
        prompt=[3, 4],
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    streamed = [chunk.usage for chunk in stream if chunk.usage][-1].completion_tokens
    # a stream's line is written once its last chunk is sent, maybe after the client read it
    said = f" POST /v1/completions 200 tokens 2+{streamed} "
    assert wait_until(lambda: said in log.read_text(), 30)
    lines = [line for line in log.read_text().splitlines() if line.startswith("jaxdd: access:")]
    assert any(" POST /v1/completions 401 tokens - " in line for line in lines)
    assert any(f" POST /v1/completions 200 tokens 3+{whole} " in line for line in lines)
    assert any(" GET /health 200 " in line for line in lines)


def choices_by_index(client, request: dict) -> dict[int, list[int]]:
    """Each choice's token ids by its index, from a streamed or whole completion."""
    options = {k: v for k, v in request.items() if k != "stream"}
    extra = {"return_token_ids": True}
    if not request.get("stream"):
        response = client.completions.create(model="kimi-mini", extra_body=extra, **options)
        return {choice.index: choice.token_ids for choice in response.choices}
    ids: dict[int, list[int]] = {}
    for chunk in client.completions.create(
        model="kimi-mini", stream=True, extra_body=extra, **options
    ):
        for choice in chunk.choices:
            ids.setdefault(choice.index, []).extend(choice.token_ids)
    return ids


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_batches_each_their_own_choice(server, reference, stream):
    """lm-eval's default body (a list of id lists) and a list of texts: each prompt decodes as it
    does alone, its choice at its index, streamed chunks routed by theirs."""
    _, client, _ = server
    run, tokenizer = reference
    texts = ["def add(a, b):", "import os\n", "class Point:"]
    prompts = [tokenizer.encode(text) for text in texts]
    expected = {i: run(prompt, 10) for i, prompt in enumerate(prompts)}
    for batch in (prompts, texts):
        request = {"prompt": batch, "max_tokens": 10, "temperature": 0, "stream": stream}
        assert choices_by_index(client, request) == expected


@pytest.mark.parametrize("stream", [False, True])
def test_n_samples_are_seeded_rows(server, reference, stream):
    """n rows of one prompt, row i seeded seed + i: each equals its run alone."""
    _, client, _ = server
    run, _ = reference
    prompt, seed = [40, 41, 42], 17
    request = {"prompt": prompt, "max_tokens": 12, "temperature": 0.8, "seed": seed, "n": 3}
    expected = {i: run(prompt, 12, 0.8, seed + i) for i in range(3)}
    assert len({tuple(ids) for ids in expected.values()}) > 1  # the rows differ
    assert choices_by_index(client, {**request, "stream": stream}) == expected
