"""The server's pool of pages under the real ``openai`` client: 18 pages (1,152 tokens) serve 16
short requests beside one of ``--max-len``, where rows of fixed size would need 17 x
``--max-len`` and even the pages their ``max_tokens`` reach 16 x 2 + 5: each is admitted at a
page and grows a page at a time, waiting a round (paused) where a page taken could leave some
request unable to end; an 18th finds a free row and a free page but waits, and starts once a
request has ended and given its pages back. The drafter's K/V are stored in fp8; the greedy ones
(the long one, the 18th) decode to what they give alone with K/V in fp32;
the 16 sampled at T=1 are each served (a draw within rounding of a boundary may go either way
in another batch size, so they are not compared token for token here: tests/decoding/test_rows.py
and tests/serve/test_server.py compare seeded rows)."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import openai
import pytest

from jaxdd.testing.server import running_server, wait_until

# the fast tier (-m 'not slow') leaves it out: its one test needs a server of its own
pytestmark = pytest.mark.slow

MAX_LEN, PAGE = 256, 64
SHORT = 16  # prompt 4 + a round's 8 take a page; + 100 tokens reach two
POOL = SHORT + 2  # and the long one's first page, and one more


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server_pages") / "server.log"
    args = ["--max-batch", str(SHORT + 2), "--max-len", str(MAX_LEN), "--max-prompt", "16"]
    args += ["--cache-tokens", str(POOL * PAGE), "--max-logprobs", "0", "--dtype", "float32"]
    args += ["--drafter-kv", "fp8"]  # the drafts change, the greedy tokens may not
    with running_server(args, log) as process:
        yield process


def ids(client: openai.OpenAI, request: dict) -> list[int]:
    response = client.completions.create(
        model="kimi-mini", extra_body={"return_token_ids": True}, **request
    )
    return response.choices[0].token_ids


def scrape(server, running: int, waiting: int) -> bool:
    """Whether one scrape finds ``running`` requests in rows and ``waiting`` queued."""
    now = server.metrics("num_requests_running", "num_requests_waiting")
    return list(now.values()) == [running, waiting]


def test_short_requests_beside_a_long_one_and_one_waiting_for_pages(server, reference):
    run, _ = reference
    assert server.metric("cache_capacity_tokens") == POOL * PAGE < (SHORT + 1) * MAX_LEN
    # the start-up line names the pool, the layout chosen (one device: replicated) and the
    # drafter's K/V
    line = f"a cache of {POOL * PAGE} tokens in pages of {PAGE}, replicated, "
    line += "the drafter's K/V in float8_e4m3fn"
    assert line in server.log.read_text()
    rng = np.random.default_rng(31)
    long = {"prompt": rng.integers(1, 4096, 12).tolist(), "max_tokens": MAX_LEN - 12}
    long["temperature"] = 0.0
    # sampled at T=1: fewer tokens a round than greedy, so they hold their pages longer
    short = [
        {"prompt": rng.integers(1, 4096, 4).tolist(), "max_tokens": 100, "seed": i}
        | {"temperature": 1.0}
        for i in range(SHORT)
    ]
    last = {"prompt": rng.integers(1, 4096, 4).tolist(), "max_tokens": 100, "temperature": 0.0}
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=300, max_retries=0)
    with concurrent.futures.ThreadPoolExecutor(SHORT + 2) as workers:
        running = [workers.submit(ids, client, r) for r in [long, *short]]
        # all 17 running, a row still free; then the 18th waits for pages
        assert wait_until(lambda: scrape(server, SHORT + 1, 0), 300)
        waiting = workers.submit(ids, client, last)
        assert wait_until(lambda: scrape(server, SHORT + 1, 1), 120)
        results = [f.result(timeout=600) for f in [*running, waiting]]
    assert results[0] == run(long["prompt"], long["max_tokens"])
    assert results[-1] == run(last["prompt"], last["max_tokens"])
    assert all(0 < len(r) <= 100 for r in results[1:-1])  # the sampled ones each served
    assert server.metric("rows_paused_total") > 0  # rows waited for pages
    assert wait_until(lambda: server.metric("kv_cache_usage_perc") == 0.0, 60)
