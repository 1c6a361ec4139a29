"""One jaxdd job over two processes (4 simulated CPU devices each, gloo collectives on a free local
port), as on two hosts: the tokens equal one process's, from an HF and from a jaxdd checkpoint, in
TP and EP, through the library and through ``python -m jaxdd.generate --coordinator``."""

import json
import sys

import pytest

import jaxdd
from jaxdd.cli import DEMO
from jaxdd.testing.multiprocess import METHODS, PROMPT, free_port, run_processes, start_job
from jaxdd.testing.server import START_SECONDS

# the fast tier (-m 'not slow') leaves it out: every test starts a job of two processes
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The demo pair's tokens on one device, and the pair saved as a jaxdd checkpoint."""
    root = tmp_path_factory.mktemp("jaxdd_pair")
    target = jaxdd.load_target(DEMO / "target", dtype="float32")
    drafter = jaxdd.load_drafter(DEMO / "drafter", dtype="float32")
    jaxdd.save_target(target.model, root / "target")
    jaxdd.save_drafter(
        drafter, root / "drafter", json.loads((DEMO / "drafter" / "config.json").read_text())
    )
    run = lambda method: target.generate(
        PROMPT, drafter=drafter, method=method, max_new_tokens=12, stop_token_ids=[]
    )
    return {method: run(method).tokens for method in METHODS}, root


def test_two_processes_give_one_process_tokens(one_process):
    expected, converted = one_process
    # Each host reads its part; EP from the HF checkpoint
    # runs in test_generate_cli_across_two_processes.
    result = start_job({"tp:hf": DEMO, "ep:jaxdd": converted}, timeout=START_SECONDS)
    assert result == {"tp:hf": expected, "ep:jaxdd": expected}


def test_generate_cli_across_two_processes(one_process):
    """Only process 0 prints; the JSON's tokens are the
    one-process ones (the processes checked each other)."""
    expected, _ = one_process
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "jaxdd.generate",
        "--prompt-ids",
        ",".join(map(str, PROMPT)),
        "--json",
    ]
    command += [
        "--method",
        "ddtree",
        "--max-new-tokens",
        "12",
        "--stop-ids",
        "-1",
        "--devices",
        "8",
        "--moe",
        "ep",
    ]
    command += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    first, second = run_processes(
        [[*command, "--process-id", str(i)] for i in range(2)], timeout=START_SECONDS
    )
    printed = [line for line in first.splitlines() if line.startswith("{")]  # gloo prints too
    assert len(printed) == 1 and json.loads(printed[0])["output_ids"] == expected["ddtree"]
    assert "output_ids" not in second
