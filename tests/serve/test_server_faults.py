"""The server against careless and hostile clients, overload, vanished clients, signals
and engine faults, on loopback with the real ``openai`` client and raw httpx bodies: every
bad request a 4xx with an OpenAI error body naming what is wrong, 429 past the queue, rows
freed when clients leave, SIGTERM / SIGINT drained to exit 0, a second signal at once, a
faulty round failing only its requests, and a short soak with nothing growing."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import signal
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from jaxdd.serve.choices import DISCONNECT_POLL
from jaxdd.serve.errors import MAX_BODY_BYTES
from jaxdd.serve.metrics import FINISH_REASONS, REFUSALS
from jaxdd.testing.server import START_SECONDS, running_server, started_server

ROWS, WAITING, MAX_LEN, MAX_PROMPT = 2, 2, 1024, 16
SHAPE = ["--max-batch", str(ROWS), "--max-waiting", str(WAITING), "--max-len", str(MAX_LEN)]
SHAPE += ["--max-prompt", str(MAX_PROMPT)]
SHAPE += ["--max-logprobs", "0"]  # rounds without top logprobs: no request here asks
# seconds: outlasts the checks
LONG = {"prompt": [5, 6, 7], "max_tokens": MAX_LEN - 16, "temperature": 1.0, "seed": 0}
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("faults")
    (folder / "chat.jinja").write_text(TEMPLATE)
    args = [*SHAPE, "--chat-template", str(folder / "chat.jinja")]
    with running_server(args, folder / "server.log", env={"JAXDD_SERVE_FAULTS": "1"}) as running:
        yield running


def post(server, body, path: str = "/v1/completions", **options) -> httpx.Response:
    return httpx.post(
        f"{server.url}{path}", json=body, timeout=options.pop("timeout", 120), **options
    )


def sse_payloads(response: httpx.Response) -> list:
    """The data of each Server-Sent Event: dicts, and the final "[DONE]"."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def finish_of(payloads: list) -> str | None:
    reasons = [
        c["finish_reason"] for p in payloads if isinstance(p, dict) for c in p.get("choices", [])
    ]
    return next((r for r in reversed(reasons) if r), None)


def raw(server, payload: bytes, headers: dict | None = None) -> httpx.Response:
    headers = {"content-type": "application/json", **(headers or {})}
    return httpx.post(f"{server.url}/v1/completions", content=payload, headers=headers, timeout=60)


BAD_BODIES = [  # (body, status, param, words the message holds)
    ({"prompt": [1, 2], "max_tokens": "many"}, 400, "max_tokens", "integer"),
    ({"prompt": [1, 2], "max_tokens": -5}, 400, "max_tokens", "greater than"),
    ({"prompt": [1, 2], "max_tokens": 2.5}, 400, "max_tokens", "fractional"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "only with echo"),
    ({"prompt": [1, 2], "max_tokens": 10**30}, 400, "max_tokens", "--max-len"),
    ({"prompt": [1, 2], "max_tokens": MAX_LEN - 1}, 400, "max_tokens", "--max-len"),
    ({"prompt": [1] * (MAX_PROMPT + 1), "max_tokens": 2}, 400, "prompt", "at most"),
    ({"prompt": [1, 2], "temperature": 2.5}, 400, "temperature", "less than"),
    ({"prompt": [1, 2], "temperature": -0.1}, 400, "temperature", "greater than"),
    ({"prompt": [1, 2], "top_p": 0}, 400, "top_p", "greater than"),
    ({"prompt": [1, 2], "top_p": 1.5}, 400, "top_p", "less than"),
    ({"prompt": [1, 2], "top_k": -2}, 400, "top_k", "greater than"),
    ({"prompt": [1, 2], "top_k": 2**40}, 400, "top_k", "less than"),
    ({"prompt": [1, 2], "seed": -1}, 400, "seed", "greater than"),
    ({"prompt": [1, 2], "n": 3}, 400, "n", "--max-batch"),
    ({"prompt": [[1]] * (ROWS + WAITING + 1)}, 400, "prompt", "--max-waiting"),
    ({"prompt": [1, 4096]}, 400, "prompt", "vocabulary"),
    ({"prompt": [1, 2**40]}, 400, "prompt", "less than"),
    ({"prompt": [1, -2]}, 400, "prompt", "greater than"),
    ({"prompt": [True, False]}, 400, "prompt", "integer"),
    ({"prompt": ["1", 2]}, 400, "prompt", "integer"),
    ({"prompt": [[1, 2], [3.5]]}, 400, "prompt", "integer"),
    ({"prompt": [[1, 2], []]}, 400, "prompt", "at least 1"),
    ({"prompt": [[1, 2], [1, 4096]]}, 400, "prompt", "vocabulary"),
    ({"prompt": ""}, 400, "prompt", "at least 1"),
    ({"prompt": []}, 400, "prompt", "at least 1"),
    ({"prompt": None}, 400, "prompt", "string"),
    ({"max_tokens": 3}, 400, "prompt", "required"),
    ({"prompt": [1, 2], "model": "gpt-9"}, 404, "model", "does not exist"),
    ({"prompt": [1, 2], "stop": [str(i) for i in range(17)]}, 400, "stop", "at most"),
    ({"prompt": [1, 2], "stop": "x" * 257}, 400, "stop", "at most 256 characters"),
    ({"prompt": [1, 2], "stop": ["x", "x" * 257]}, 400, "stop", "at most 256 characters"),
    (
        {"prompt": [1, 2], "stop_token_ids": list(range(1, 17))},
        400,
        "stop_token_ids",
        "at most 15 beside",
    ),
    ({"prompt": [1, 2], "stop_token_ids": [10**6]}, 400, "stop_token_ids", "vocabulary"),
    ({"prompt": [1, 2], "stream_options": "yes"}, 400, "stream_options", "dictionary"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("body", "status", "param", "words"), BAD_BODIES)
def test_bad_request_names_what_is_wrong(server, body, status, param, words):
    response = post(server, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (
        error["param"] == param
        and words in error["message"]
        and error["type"] == "invalid_request_error"
    )


@pytest.mark.parametrize(
    ("payload", "headers", "status", "words"),
    [
        (b"{not json", None, 400, "not valid JSON"),
        (b"", None, 400, "empty"),
        (b"[1, 2]", None, 400, "JSON object"),
        (b'"text"', None, 400, "JSON object"),
        (b'{"prompt": "\xff\xfe"}', None, 400, "could not be read"),
        (b"[" * 100_000 + b"]" * 100_000, None, 400, "could not be read"),
        (b'{"prompt": [1, 2]}', {"content-type": "text/plain"}, 415, "application/json"),
        (
            b"prompt=1",
            {"content-type": "application/x-www-form-urlencoded"},
            415,
            "application/json",
        ),
    ],
)
def test_malformed_body_gets_an_error_body(server, payload, headers, status, words):
    response = raw(server, payload, headers)
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"]


def test_oversized_bodies_413_declared_or_chunked(server):
    big = json.dumps({"prompt": "a" * (2 * MAX_BODY_BYTES), "max_tokens": 2}).encode()
    declared = raw(server, big)

    def chunks():
        for at in range(0, len(big), 65536):
            yield big[at : at + 65536]

    chunked = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=60)
    assert chunked.request.headers.get("transfer-encoding") == "chunked"
    for response in (declared, chunked):
        assert (
            response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
        )


def test_chat_bad_requests_and_the_openai_client(server):
    bad_chat = [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ]
    for body, param in bad_chat:
        response = post(server, body, "/v1/chat/completions")
        assert response.status_code == 400 and response.json()["error"]["param"] == param
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=60, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="--max-len"):
        client.completions.create(model="kimi-mini", prompt=[1, 2], max_tokens=MAX_LEN * 4)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert (
        client.completions.create(
            model="kimi-mini", prompt=[1, 2], max_tokens=3
        ).usage.completion_tokens
        == 3
    )


def counted(server, metric: str, label: str, values: tuple[str, ...]) -> dict[str, float]:
    return {value: server.metric(f'{metric}{{{label}="{value}"}}') for value in values}


def ends(server) -> dict[str, float]:
    """jaxdd:request_success_total by finish reason."""
    return counted(server, "request_success_total", "finished_reason", FINISH_REASONS)


def refusals(server) -> dict[str, float]:
    """jaxdd:request_refused_total by reason."""
    return counted(server, "request_refused_total", "reason", REFUSALS)


def change(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before[key] for key in before if after[key] != before[key]}


def test_overload_refused_at_once_and_every_admitted_request_completes(server):
    ended, refused_before = ends(server), refusals(server)
    count = 4 * (ROWS + WAITING)
    start = threading.Barrier(count)

    def send(i: int) -> tuple[int, float, dict]:
        start.wait()
        began = time.monotonic()
        response = post(
            server, {"prompt": [3, 4, i], "max_tokens": 64, "temperature": 1.0, "seed": i}
        )
        return response.status_code, time.monotonic() - began, response.json()

    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        results = list(pool.map(send, range(count)))
    refused = [r for r in results if r[0] == 429]
    served = [r for r in results if r[0] == 200]
    assert refused and len(refused) + len(served) == count and len(served) >= ROWS + WAITING
    assert all(r[2]["error"]["code"] == "rate_limit_exceeded" for r in refused)
    assert f"--max-waiting {WAITING}" in refused[0][2]["error"]["message"]
    assert all(r[2]["choices"][0]["finish_reason"] == "length" for r in served)
    assert all(r[2]["usage"]["completion_tokens"] == 64 for r in served)
    # refused without waiting for a row
    assert max(r[1] for r in refused) < max(r[1] for r in served)
    assert server.wait_until(lambda: server.metric("num_requests_running") == 0, 30)
    assert change(refused_before, refusals(server)) == {"queue_full": len(refused)}
    assert change(ended, ends(server)) == {"length": len(served)}


def rows_free(server) -> bool:
    return server.metric("num_requests_running") == 0 and server.metric("num_requests_waiting") == 0


def test_a_stream_whose_socket_closes_frees_its_row(server):
    before = server.metric("generation_tokens_total")
    body = json.dumps({**LONG, "stream": True}).encode()
    connection = socket.create_connection(
        ("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=30
    )
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
        f"application/json\r\nContent-Length: {len(body)}"
    )
    connection.sendall(head.encode() + b"\r\n\r\n" + body)
    assert b"200 OK" in connection.recv(4096)
    assert server.wait_until(lambda: server.metric("num_requests_running") == 1, 10)
    # reset
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    connection.close()
    assert server.wait_until(lambda: rows_free(server), 10)
    assert server.metric("generation_tokens_total") - before < LONG["max_tokens"]


def test_a_client_read_timeout_frees_its_row(server):
    before = server.metric("generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        post(server, LONG, timeout=httpx.Timeout(30, read=0.5))
    assert server.wait_until(lambda: rows_free(server), 10)
    assert server.metric("generation_tokens_total") - before < LONG["max_tokens"]


def test_queued_requests_that_leave_or_time_out_end_while_every_row_is_busy(server):
    """With both rows busy, a queued client that leaves stops counting as waiting, and a queued
    request past its timeout ends ("timeout"), at the next step: neither waits for a row to free."""
    prompt_tokens = server.metric("prompt_tokens_total")
    with httpx.Client(base_url=server.url, timeout=60) as client, contextlib.ExitStack() as streams:
        lines = []  # kept: a dropped line iterator closes its stream
        for _ in range(ROWS):
            response = streams.enter_context(
                client.stream("POST", "/v1/completions", json={**LONG, "stream": True})
            )
            lines.append(response.iter_lines())
            next(lines[-1])
        assert server.wait_until(lambda: server.metric("num_requests_running") == ROWS, 10)
        with pytest.raises(httpx.ReadTimeout):
            post(server, LONG, timeout=httpx.Timeout(30, read=0.5))
        # The server notices a waiting client's leaving at its next look.
        assert server.wait_until(
            lambda: server.metric("num_requests_waiting") == 0, 4 * DISCONNECT_POLL + 2
        )
        timed = post(server, {**LONG, "timeout": 0.2}, timeout=10).json()
        assert (
            timed["choices"][0]["finish_reason"] == "timeout"
            and timed["usage"]["completion_tokens"] == 0
        )
        assert server.metric("num_requests_running") == ROWS  # the rows were busy throughout
    assert server.wait_until(lambda: rows_free(server), 10)
    assert post(server, {"prompt": [1, 2], "max_tokens": 2}).status_code == 200
    # the queued prompt never ran
    assert server.metric("prompt_tokens_total") - prompt_tokens == ROWS * 3 + 2


def test_engine_fault_fails_its_round_and_serving_goes_on(server):
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}, timeout=60
    ) as streamed:
        lines = streamed.iter_lines()
        next(lines)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            whole = pool.submit(post, server, LONG)
            assert server.wait_until(lambda: server.metric("num_requests_running") == 2, 30)
            assert post(server, {"rounds": 1}, "/debug/fault").status_code == 200
            payloads = [json.loads(p[6:]) if p != "data: [DONE]" else "[DONE]" for p in lines if p]
            failed = whole.result(60)
    assert payloads[-1] == "[DONE]" and "engine fault" in payloads[-2]["error"]["message"]
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
    assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=60, max_retries=0)
    after = client.completions.create(
        model="kimi-mini", prompt=[1, 2, 3], max_tokens=12, temperature=0
    )
    assert after.choices[0].finish_reason == "length" and after.usage.completion_tokens == 12


def test_metrics_count_each_refusal_and_each_end(server):
    """Each refused request counted under its reason, each request that ran under how it ended (what
    its client was told; abort: the client left)."""
    assert server.wait_until(lambda: rows_free(server), 30)  # what earlier tests ran is counted
    refused_before = refusals(server)
    assert post(server, {"prompt": [1, 2], "top_p": 7}).status_code == 400
    assert post(server, {"prompt": [1, 2], "model": "gpt-9"}).status_code == 404
    assert raw(server, b"{not json").status_code == 400
    assert raw(server, b"prompt=1", {"content-type": "text/plain"}).status_code == 415
    assert post(server, {"prompt": [1] * (MAX_PROMPT + 1), "max_tokens": 2}).status_code == 400
    assert post(server, {"prompt": [1, 2], "max_tokens": MAX_LEN - 1}).status_code == 400
    big = json.dumps({"prompt": "a" * MAX_BODY_BYTES}).encode()
    assert raw(server, big).status_code == 413
    assert change(refused_before, refusals(server)) == {"invalid": 4, "too_long": 3}
    ended = ends(server)
    greedy = {"prompt": [4, 5, 6], "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    whole = post(server, greedy).json()["choices"][0]
    first = whole["token_ids"][:1]
    stopped = post(server, {**greedy, "stop_token_ids": first}).json()["choices"][0]
    timed = post(server, {**LONG, "timeout": 0.2}).json()["choices"][0]
    reasons = [choice["finish_reason"] for choice in (whole, stopped, timed)]
    assert reasons == ["length", "stop", "timeout"]
    with pytest.raises(httpx.ReadTimeout):  # the client leaves
        post(server, LONG, timeout=httpx.Timeout(30, read=0.5))
    url, streamed = f"{server.url}/v1/completions", {**LONG, "stream": True}
    with httpx.stream("POST", url, json=streamed, timeout=60) as left:
        next(left.iter_lines())
    assert server.wait_until(lambda: change(ended, ends(server)).get("abort") == 2, 10)
    with httpx.stream("POST", url, json=streamed, timeout=60) as failed:
        lines = failed.iter_lines()
        next(lines)
        assert post(server, {"rounds": 1}, "/debug/fault").status_code == 200
        assert "engine fault" in "".join(lines)
    expected = {"length": 1, "stop": 1, "timeout": 1, "abort": 2, "error": 1}
    assert server.wait_until(lambda: change(ended, ends(server)) == expected, 10)
    assert server.wait_until(lambda: rows_free(server), 10)


@pytest.mark.slow
def test_serving_is_said_once_health_answers(tmp_path):
    with started_server(SHAPE, tmp_path / "server.log") as server:
        said = lambda: "jaxdd: note: serving" in server.log.read_text()
        assert server.wait_until(lambda: said() or server.process.poll() is not None, START_SECONDS)
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert said() and health.status_code == 200, server.log.read_text()


def soak_request(rng: np.random.Generator, i: int) -> dict:
    prompt = rng.integers(1, 4096, size=int(rng.integers(1, MAX_PROMPT + 1))).tolist()
    return {
        "prompt": prompt,
        "max_tokens": int(rng.integers(1, 12)),
        "temperature": float(rng.choice([0, 0.8])),
        "seed": i,
        "stream": bool(i % 2),
    }


@pytest.mark.slow
def test_soak_nothing_grows_after_warm_up(server):
    """A few hundred mixed requests (streamed or not, some bad, some abandoned): RSS,
    threads, open files and compiled executables do not grow past the warm-up's."""
    rng = np.random.default_rng(41)
    bodies = [soak_request(rng, i) for i in range(300)]

    def one(i: int) -> int:
        body = bodies[i]
        if i % 10 == 3:
            body["top_p"] = 7  # a bad request
        # a client that leaves at once (unless the queue is full: a 429 comes first)
        if i % 10 == 7:
            try:
                timeout = httpx.Timeout(30, read=0.05)
                return post(
                    server, {**body, "max_tokens": MAX_LEN - MAX_PROMPT}, timeout=timeout
                ).status_code
            except httpx.ReadTimeout:
                return 499
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json=body, timeout=120
        ) as response:
            response.read()
            return response.status_code

    def batch(first: int, count: int) -> list[int]:
        with concurrent.futures.ThreadPoolExecutor(ROWS + WAITING) as pool:
            return list(pool.map(one, range(first, first + count)))

    assert set(batch(0, 60)) <= {200, 400, 429, 499}
    assert server.wait_until(lambda: rows_free(server), 30)
    before, compiles = server.usage(), server.metric("compiles_total")
    statuses = batch(60, 240)
    assert server.wait_until(lambda: rows_free(server), 30)
    after = server.usage()
    assert (
        statuses.count(200) >= 120
        and statuses.count(400) == 24
        and set(statuses) <= {200, 400, 429, 499}
    )
    assert server.metric("compiles_total") == compiles
    assert after["threads"] <= before["threads"] and after["fds"] <= before["fds"] + 4
    assert after["rss_mb"] - before["rss_mb"] < 64


def long_stream(url: str, out: list) -> None:
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**LONG, "stream": True}, timeout=120
    ) as response:
        out.extend(sse_payloads(response))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_drains_then_exits_0(tmp_path, sig):
    """A short and a long stream in flight: the short one finishes,
    the long one ends at the drain timeout with "abort"; both end with
    ``[DONE]``; no new request is admitted; the process exits 0."""
    with running_server([*SHAPE, "--drain-timeout", "2"], tmp_path / "server.log") as server:
        long = []
        thread = threading.Thread(target=long_stream, args=(server.url, long))
        thread.start()
        assert server.wait_until(lambda: server.metric("num_requests_running") == 1, 30)
        body = {"prompt": [1, 2], "max_tokens": 24, "temperature": 0, "stream": True}
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json=body, timeout=120
        ) as response:
            lines = response.iter_lines()
            first = next(lines)
            server.process.send_signal(sig)
            short = [first, *lines]
        assert server.exit_code(60) == 0, server.log.read_text()
        thread.join(30)
        short = [line.removeprefix("data: ") for line in short if line]
        assert (
            short[-1] == "[DONE]"
            and finish_of([json.loads(line) for line in short[:-1]]) == "length"
        )
        assert long[-1] == "[DONE]" and finish_of(long) == "abort"
        with pytest.raises(httpx.ConnectError):
            post(server, {"prompt": [1], "max_tokens": 2})


def cut_stream(url: str) -> None:
    """A long stream the server's exit cuts short."""
    with contextlib.suppress(httpx.RemoteProtocolError):
        long_stream(url, [])


@pytest.mark.slow
def test_second_signal_exits_at_once(tmp_path):
    with running_server([*SHAPE, "--drain-timeout", "600"], tmp_path / "server.log") as server:
        thread = threading.Thread(target=cut_stream, args=(server.url,), daemon=True)
        thread.start()
        assert server.wait_until(lambda: server.metric("num_requests_running") == 1, 30)
        server.process.send_signal(signal.SIGTERM)
        assert server.wait_until(lambda: "draining" in server.log.read_text(), 30)
        assert server.process.poll() is None  # still draining the stream
        server.process.send_signal(signal.SIGINT)
        assert server.exit_code(30) == 128 + signal.SIGINT
        assert "without draining" in server.log.read_text()


@pytest.mark.slow
def test_an_engine_that_cannot_recover_says_so(tmp_path):
    with running_server(
        [*SHAPE], tmp_path / "server.log", env={"JAXDD_SERVE_FAULTS": "1"}
    ) as server:
        assert post(server, {"rounds": 1, "fatal": True}, "/debug/fault").status_code == 200
        failed = post(server, LONG)
        assert failed.status_code == 500 and "engine fault" in failed.json()["error"]["message"]
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503 and "cannot be reset" in health.json()["error"]["message"]
        refused = post(server, {"prompt": [1, 2], "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready"
        server.process.send_signal(signal.SIGTERM)
        assert server.exit_code(60) == 0
