"""python -m jaxdd.serve as a job of two processes x 4 simulated CPU devices (gloo on
loopback), as on two hosts: process 0 serves HTTP and decides, process 1 follows; concurrent
requests through the ``openai`` client decode to their runs alone; SIGTERM ends both with
exit 0 when process 0 decides; a follower whose process 0 vanished exits at once. And
``--method ar`` through such a job (2 x 2 devices) equals ``python -m jaxdd.generate``."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import sys

import openai
import pytest

from jaxdd.serve.decisions import LOST
from jaxdd.testing.server import START_SECONDS, complete, running_job

# the fast tier (-m 'not slow') leaves it out: every test needs a job of two server processes
pytestmark = pytest.mark.slow

ROWS, MAX_LEN, MAX_PROMPT = 2, 64, 16
SHAPE = ["--max-batch", str(ROWS), "--max-len", str(MAX_LEN), "--max-prompt", str(MAX_PROMPT)]
SHAPE += ["--max-logprobs", "0"]  # rounds without top logprobs: no request here asks
# --coordinator-timeout: the join's and a follower's patience; past any step on a loaded machine
# (a hang's exit has its own test in test_decisions), so a slow round never ends the job
SILENCE = 300
REQUESTS = [  # more than there are rows: some wait, and are admitted between rounds of the others
    {"prompt": [1, 2, 3, 4, 5, 6, 7], "max_tokens": 20, "temperature": 0.0},
    {
        "prompt": [9, 400, 17, 3000],
        "max_tokens": 16,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 11,
        "stream": True,
    },
    {"prompt": list(range(100, 116)), "max_tokens": 24, "temperature": 0.0, "stream": True},
    {"prompt": [5, 6, 7], "max_tokens": 12, "temperature": 0.7, "seed": 2**32 - 1},
]


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)


def expected(run, request: dict, method: str) -> list[int]:
    settings = [request.get(k, d) for k, d in (("temperature", 0.0), ("seed", 0), ("top_p", 1.0))]
    return run(request["prompt"], request["max_tokens"], *settings, method=method)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve_hosts")
    args = [*SHAPE, "--devices", "8", "--moe", "ep", "--coordinator-timeout", str(SILENCE)]
    with running_job(args, folder) as running:
        yield running


def test_two_processes_serve_what_one_decodes(job, reference):
    server, _ = job
    run, _ = reference
    client = client_for(server.url)
    with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
        results = list(pool.map(lambda r: complete(client, r), REQUESTS))
    for request, (ids, _, finish, usage) in zip(REQUESTS, results, strict=True):
        assert ids == expected(run, request, "dflash"), request
        assert finish == ("length" if len(ids) == request["max_tokens"] else "stop")
        assert usage["completion_tokens"] == len(ids)


def test_sigterm_to_process_0_ends_both_with_0(job):
    """After the other tests of ``job``: it ends the job. The follower's own SIGTERM
    (a job manager signals every process) waits for process 0's decision."""
    server, (follower,) = job
    follower.send_signal(signal.SIGTERM)
    with pytest.raises(subprocess.TimeoutExpired):
        follower.wait(2)
    # still serving: the follower still follows
    assert complete(client_for(server.url), REQUESTS[0])[0]
    server.process.send_signal(signal.SIGTERM)
    assert server.exit_code(60) == 0, server.log.read_text()
    assert follower.wait(60) == 0


@pytest.fixture(scope="module")
def ar_job(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve_hosts_ar")
    args = [
        *SHAPE,
        "--method",
        "ar",
        "--devices",
        "4",
        "--moe",
        "tp",
        "--coordinator-timeout",
        str(SILENCE),
    ]
    with running_job(args, folder) as running:
        yield running, folder


def test_ar_through_the_server_equals_generate(ar_job, reference):
    """--method ar: concurrent requests equal their runs alone, and a seeded sampled one what
    python -m jaxdd.generate --no-chat --method ar gives."""
    (server, _), _ = ar_job
    run, _ = reference
    client = client_for(server.url)
    with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
        results = list(pool.map(lambda r: complete(client, r), REQUESTS))
    for request, (ids, *_) in zip(REQUESTS, results, strict=True):
        assert ids == expected(run, request, "ar"), request
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
    argv += ["--method", "ar", "--temperature", "0.8", "--seed", "11", "--dtype", "float32"]
    cli = json.loads(
        subprocess.run(
            argv, capture_output=True, text=True, check=True, timeout=START_SECONDS
        ).stdout
    )
    ids, text, _, _ = complete(
        client, {"prompt": prompt, "max_tokens": 24, "temperature": 0.8, "seed": 11}
    )
    assert ids == cli["output_ids"] and text == cli["text"]


def test_a_follower_whose_process_0_vanished_exits(ar_job):
    """Last in this file: process 0 killed outright (no stop broadcast): the follower
    exits at once, non-zero, saying why: its broken broadcast in one line (exit
    LOST), or JAX's own client, when it notices first, aborts it (SIGABRT) with its
    line on the dead coordination service. Either way it does not wait for anyone."""
    (server, (follower,)), folder = ar_job
    server.process.send_signal(signal.SIGKILL)
    code = follower.wait(120)  # a broken broadcast, not the silence, ends it
    log = (folder / "process1.log").read_text()
    ours = [line for line in log.splitlines() if line.startswith("jaxdd: ")][-1].startswith(
        "jaxdd: lost process 0 ("
    )
    theirs = "Terminating process because the JAX distributed service detected fatal errors" in log
    assert (code == LOST and ours) or (code == -signal.SIGABRT and theirs), log[-3000:]
