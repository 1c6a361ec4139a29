"""The server's prefix cache (on by default), through the real ``openai`` client: a
conversation's second turn resends the first turn's prompt and answer; it finds their pages
cached, says so in ``usage.prompt_tokens_details.cached_tokens`` and in vLLM's metrics, and
decodes to what its full prompt gives alone; ``jaxdd:cache_pages`` then counts the pages kept."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from jaxdd.testing.server import complete, running_server

# the fast tier (-m 'not slow') leaves it out: its one test needs a server of 160-token prompts
pytestmark = pytest.mark.slow

# the first turn's prompt; with its 80-token answer and a 20-token message, the second turn's
# prompt is 160 tokens: the server's prompt buckets (each a prefill to warm up, and one after a
# hit) end at 160
FIRST, ANSWER, MESSAGE = 60, 80, 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("prefix_cache") / "server.log"
    args = ["--max-batch", "2", "--max-len", "192", "--max-prompt", "160", "--dtype", "float32"]
    args += ["--max-logprobs", "0"]  # no scoring prefills to warm: no request here asks
    with running_server(args, log) as process:
        yield process


def test_a_second_turn_reuses_the_first_and_decodes_as_alone(server, reference):
    run, _ = reference
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120, max_retries=0)
    rng = np.random.default_rng(21)
    prompt = rng.integers(1, 4096, FIRST).tolist()
    first = {"prompt": prompt, "max_tokens": ANSWER, "temperature": 0.0}
    said, _, _, usage = complete(client, first)
    assert said == run(first["prompt"], ANSWER) and len(said) == ANSWER
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    history = first["prompt"] + said + rng.integers(1, 4096, MESSAGE).tolist()
    second = {"prompt": history, "max_tokens": 24, "temperature": 0.7, "seed": 3, "stream": True}
    ids, _, _, usage = complete(client, second)
    assert ids == run(history, 24, 0.7, 3)
    # two pages of 64: the first prompt and the answer but its last round (the drafter's lag)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 128}
    assert server.metric("prefix_cache_queries_total") == FIRST + len(history)
    assert server.metric("prefix_cache_hits_total") == 128
    # idle: none held; cached, the two pages found (the second turn's 160 + 23 committed tokens
    # less the drafter's lag fill no third), the rest free
    pool = server.metric("cache_capacity_tokens") // 64
    pages = {s: server.metric(f'cache_pages{{state="{s}"}}') for s in ("free", "cached", "held")}
    assert pages == {"free": pool - 2, "cached": 2, "held": 0}
