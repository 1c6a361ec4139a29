"""The refusals a running server shows a client only briefly, made in-process on the HTTP side
alone (the scheduler's thread never starts, so nothing compiles): a request while compiling is
refused as not_ready, one while draining as draining, each a 503 counted under its reason; one
without the server's API key a 401 (unauthorized); each request an access-log line."""

from __future__ import annotations

import re

from starlette.testclient import TestClient

from jaxdd.serve.__main__ import build_parser
from jaxdd.serve.app import Server, create_app
from jaxdd.serve.metrics import REFUSALS, Metrics
from jaxdd.serve.scheduler import Scheduler


def refusals(client: TestClient) -> dict[str, float]:
    """jaxdd:request_refused_total by reason, as /metrics says."""
    text = client.get("/metrics").text
    found = re.findall(r'^jaxdd:request_refused_total\{reason="(\w+)"\} (\S+)$', text, re.MULTILINE)
    return {reason: float(value) for reason, value in found}


def test_compiling_and_draining_refusals_are_counted(pool):
    scheduler = Scheduler(pool, Metrics(pool.shape.spec.block), max_waiting=1)
    client = TestClient(create_app(Server(scheduler, None, "kimi-mini", [0], None, None)))
    assert refusals(client) == dict.fromkeys(REFUSALS, 0.0)
    body = {"prompt": [1, 2], "max_tokens": 2}
    compiling = client.post("/v1/completions", json=body)
    assert compiling.status_code == 503 and "compiling" in compiling.json()["error"]["message"]
    scheduler.ready.set()  # as the scheduler's thread does after its compiles
    scheduler.drain(60)
    draining = client.post("/v1/completions", json=body)
    assert draining.status_code == 503 and "shutting down" in draining.json()["error"]["message"]
    assert refusals(client) == {**dict.fromkeys(REFUSALS, 0.0), "not_ready": 1.0, "draining": 1.0}


def test_api_key_and_access_log(pool, capsys):
    """With a key, every route but /health and /metrics wants it (a 401 with OpenAI's body,
    counted as unauthorized); each request gets one access-log line."""
    scheduler = Scheduler(pool, Metrics(pool.shape.spec.block), max_waiting=1)
    server = Server(scheduler, None, "kimi-mini", [0], None, None, "s3cret", True)
    client = TestClient(create_app(server))
    body = {"prompt": [1, 2], "max_tokens": 2}
    missing = client.post("/v1/completions", json=body)
    wrong = client.get("/v1/models", headers={"Authorization": "Bearer guess"})
    for response, words in ((missing, "no API key"), (wrong, "incorrect")):
        error = response.json()["error"]
        assert response.status_code == 401 and error["code"] == "invalid_api_key"
        assert words in error["message"] and error["type"] == "invalid_request_error"
    key = {"Authorization": "Bearer s3cret"}
    assert client.get("/v1/models", headers=key).json()["data"][0]["id"] == "kimi-mini"
    # past the key, the request reaches the queue (the server is still compiling)
    assert client.post("/v1/completions", json=body, headers=key).status_code == 503
    assert client.get("/health").status_code == 503  # open: it says "compiling", not 401
    assert refusals(client)["unauthorized"] == 2.0
    lines = [line for line in capsys.readouterr().err.splitlines() if "access:" in line]
    assert len(lines) == 6 and lines[-1].startswith("jaxdd: access: GET /metrics 200 tokens -")
    assert re.fullmatch(r"jaxdd: access: POST /v1/completions 401 tokens - \d+\.\d{3} s", lines[0])


def test_served_model_name_is_model_name():
    """vLLM's flag names the model as --model-name does; the key comes from the flag or the
    environment."""
    parser = build_parser()
    assert parser.parse_args(["--served-model-name", "mine"]).model_name == "mine"
    assert parser.parse_args(["--api-key", "k"]).api_key == "k"
    assert parser.parse_args(["--no-access-log"]).access_log is False
