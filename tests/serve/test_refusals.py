"""The refusals a running server shows a client only briefly, made in-process on the HTTP side
alone (the scheduler's thread never starts, so nothing compiles): a request while compiling is
refused as not_ready, one while draining as draining, each a 503 counted under its reason."""

from __future__ import annotations

import re

import pytest
from starlette.testclient import TestClient

import jaxdd
from jaxdd.cli import DEMO
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.decoding.rows import RowPool
from jaxdd.serve.app import Server, create_app
from jaxdd.serve.metrics import REFUSALS, Metrics
from jaxdd.serve.scheduler import Scheduler


@pytest.fixture(scope="module")
def pool():
    target, drafter = jaxdd.load_pair(DEMO / "target", DEMO / "drafter", "float32")
    decoder = SpeculativeDecoder(target, drafter)
    return RowPool(decoder, method="dflash", rows=1, max_len=64, max_prompt=8)


def refusals(client: TestClient) -> dict[str, float]:
    """jaxdd:request_refused_total by reason, as /metrics says."""
    text = client.get("/metrics").text
    found = re.findall(r'^jaxdd:request_refused_total\{reason="(\w+)"\} (\S+)$', text, re.MULTILINE)
    return {reason: float(value) for reason, value in found}


def test_compiling_and_draining_refusals_are_counted(pool):
    scheduler = Scheduler(pool, Metrics(pool.block), max_waiting=1)
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
