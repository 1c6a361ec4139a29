"""Process 0's decisions as a follower receives them: exactly (the floats, a
seed near 2**32, every field), in the order they were broadcast; a follower
whose broadcast breaks, or that hears nothing, exits in one line."""

import subprocess
import sys

import pytest

from jaxdd.decoding.requests import RowRequest
from jaxdd.decoding.sampling import Sampling
from jaxdd.serve.decisions import LOST, Broadcast, Decisions

ROWS, MAX_PROMPT = 4, 16
STEPS = [
    Decisions(),
    Decisions(
        release=(3, 0),
        admit=(
            RowRequest([7] * MAX_PROMPT, 9, [0, 163586], Sampling(0.7, 0.9, 3, 2**32 - 1)),
            RowRequest([1], 1, [], Sampling()),
            RowRequest([2, 3], 0, [0], Sampling(), logprobs=5, score_prompt=True),
            RowRequest([4], 2, [], Sampling(), logprobs=0),
        ),
    ),
    Decisions(reset=True),
    Decisions(release=(0, 1, 2, 3)),
    Decisions(stop=True),
]


def test_a_follower_receives_exactly_what_process_0_decided():
    sent = []

    def record(values):
        sent.append(values.copy())
        return values

    leader = Broadcast(ROWS, MAX_PROMPT, 3600, leads=True, broadcast=record)
    assert [leader.share(lambda step=step: step) for step in STEPS] == STEPS
    replay = iter(sent)
    follower = Broadcast(ROWS, MAX_PROMPT, 3600, leads=False, broadcast=lambda _: next(replay))
    # its own decisions are unused
    assert [follower.share(lambda: Decisions(stop=True)) for _ in STEPS] == STEPS
    assert next(replay, None) is None


FOLLOWER = """
import sys, time
from jaxdd.serve.decisions import Broadcast
def hang(values):
    time.sleep(600)
def broken(values):
    raise ValueError("UNKNOWN: Gloo all-reduce failed: Connection closed by peer\\nmore")
Broadcast(2, 16, 1.0, leads=False, broadcast={"hang": hang, "broken": broken}[sys.argv[1]]).share(None)
"""  # noqa: E501


@pytest.mark.slow
def test_a_follower_that_loses_process_0_exits_in_one_line():
    for how, line in [
        (
            "broken",
            "jaxdd: lost process 0 (ValueError: UNKNOWN: Gloo all-reduce failed: "
            "Connection closed by peer)",
        ),
        ("hang", "jaxdd: process 0 sent nothing for 1 s"),
    ]:
        run = subprocess.run(
            [sys.executable, "-c", FOLLOWER, how], capture_output=True, text=True, timeout=120
        )
        assert run.returncode == LOST and run.stderr.splitlines()[-1] == f"{line}: exiting", (
            run.stderr
        )
