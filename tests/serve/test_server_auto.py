"""python -m jaxdd.serve --method ddtree --budget auto: the start-up line names the set of rounds,
concurrent greedy requests decode plain greedy tokens, /metrics counts the rounds of each spec and
the current choice, and nothing compiles after warm-up; --budget auto with plain decoding is one
line, exit 2."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys

import numpy as np
import openai
import pytest

from jaxdd.testing.server import complete, free_port, running_server

SPECS = ("ddtree-7", "ddtree-3", "ar")  # the demo drafter's block 8: budgets 7 and 3


@pytest.mark.slow
def test_an_auto_server_decodes_plain_greedy_tokens_and_counts_its_rounds(tmp_path, reference):
    run, _ = reference
    log = tmp_path / "server.log"
    args = ["--method", "ddtree", "--budget", "auto", "--max-batch", "4", "--max-len", "128"]
    args += ["--max-prompt", "16", "--max-logprobs", "0", "--prefix-cache", "off"]
    with running_server(args, log) as server:
        compiles = server.metric("compiles_total")
        names = [f'rounds_total{{spec="{s}"}}' for s in SPECS]
        assert set(server.metrics(*names).values()) == {0}  # warm-up times rounds, counts none
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
        rng = np.random.default_rng(5)
        requests = [
            {"prompt": rng.integers(1, 4096, size=8).tolist(), "max_tokens": 40, "temperature": 0}
            for _ in range(6)
        ]
        with concurrent.futures.ThreadPoolExecutor(6) as workers:
            outputs = list(workers.map(lambda r: complete(client, r)[0], requests))
        for request, output in zip(requests, outputs, strict=True):
            assert output == run(request["prompt"], request["max_tokens"], method="ar")
        counts = server.metrics(*names)
        choice = server.metrics(*(f'round_choice{{spec="{s}"}}' for s in SPECS))
        drafts = server.metric("spec_decode_num_drafts_total")
        proposed = server.metric("spec_decode_num_draft_tokens_total")
        per_round = server.metric("acceptance_length_count")
        assert server.metric("compiles_total") == compiles
    assert sum(counts.values()) > 0 and sum(choice.values()) == 1
    # a draft proposes its own round's budget; a plain round is a round, not a draft
    assert 3 * drafts <= proposed <= 7 * drafts
    if counts['rounds_total{spec="ddtree-3"}'] > 0:
        assert proposed < 7 * drafts
    if counts['rounds_total{spec="ar"}'] > 0:
        assert per_round > drafts
    assert f"rounds chosen among {'/'.join(SPECS)}" in log.read_text()


def test_auto_with_plain_decoding_is_refused_in_one_line():
    command = [sys.executable, "-m", "jaxdd.serve", "--method", "ar", "--budget", "auto"]
    command += ["--port", str(free_port())]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("jaxdd: ")
    assert "Traceback" not in done.stderr
