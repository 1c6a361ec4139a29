"""The chooser of ``--budget auto`` on a fake clock: it picks the highest tokens per second at
the round's tier, learns times and acceptance from rounds collected, holds its choice against
small differences, runs unmeasured specs at once and re-probes stale ones, and a busy host's
slowdown, or a prefill's time, does not change its choice."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxdd.decoding.speculation import PLAIN, Chooser

NAMES = ("ddtree-16", "ddtree-8", PLAIN)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(chooser: Chooser, clock: Clock, tier: int, seconds: dict, tokens: dict) -> str:
    """One round dispatched and collected: ``seconds[name]`` later, each of ``tier`` rows given
    ``tokens[name]``."""
    ticket = chooser.choose(tier)
    clock.now += seconds[ticket.name]
    chooser.collected(ticket, [tokens[ticket.name]] * tier)
    return ticket.name


def profile(chooser: Chooser, clock: Clock, name: str, tier: int, seconds: float) -> None:
    """A warm-up run of ``seconds``, and a slower one (the profile keeps the fastest)."""
    for run in (seconds, 3 * seconds):
        with chooser.timing(name, tier):
            clock.now += run


def profiled(clock: Clock, seconds: dict, tiers=(1,), **options) -> Chooser:
    chooser = Chooser(NAMES, clock, **options)
    for name in NAMES:
        for tier in tiers:
            profile(chooser, clock, name, tier, seconds[name])
    return chooser


def test_it_runs_unknown_specs_first_then_the_fastest_per_token():
    clock, seconds = Clock(), {"ddtree-16": 0.03, "ddtree-8": 0.02, PLAIN: 0.01}
    tokens = {"ddtree-16": 5, "ddtree-8": 4, PLAIN: 1}  # 167, 200, 100 tokens/s
    chooser = profiled(clock, seconds)
    ran = [run(chooser, clock, 1, seconds, tokens) for _ in range(20)]
    # not measured while serving yet: each runs its first three rounds
    assert ran[:9] == ["ddtree-16"] * 3 + ["ddtree-8"] * 3 + [PLAIN] * 3
    assert set(ran[9:]) == {"ddtree-8"}
    assert chooser.rounds == {"ddtree-16": 3, "ddtree-8": 14, PLAIN: 3}


def test_plain_decoding_wins_where_rounds_cost_what_they_give():
    clock, seconds = Clock(), {"ddtree-16": 0.06, "ddtree-8": 0.03, PLAIN: 0.01}
    tokens = {"ddtree-16": 3, "ddtree-8": 2, PLAIN: 1}  # 50, 67, 100 tokens/s
    chooser = profiled(clock, seconds)
    ran = [run(chooser, clock, 1, seconds, tokens) for _ in range(17)]
    assert ran[9:] == [PLAIN] * 8


def test_each_tier_has_its_own_times():
    clock = Clock()
    chooser = Chooser(NAMES, clock, samples=0)  # the warm-up's profile alone
    for tier, times in ((1, (0.02, 0.015, 0.01)), (16, (0.2, 0.1, 0.02))):
        for name, seconds in zip(NAMES, times, strict=True):
            profile(chooser, clock, name, tier, seconds)
    chooser.tokens.update({"ddtree-16": 6.0, "ddtree-8": 4.0})
    assert chooser.choose(1).name == "ddtree-16"  # 300 tokens/s against 267 and 100
    assert chooser.choose(16).name == PLAIN  # 50 per row against 30, 40


def test_what_every_round_pays_besides_its_own_cost_favours_wider_rounds():
    """The profile times each round alone; serving adds 20 ms a round (the host's bookkeeping),
    learnt from each spec's first rounds served, which then makes the one giving more a round
    worth its cost: 4.5 / 40 ms beats 3 / 30 ms, where alone 4.5 / 20 ms lost to 3 / 10 ms."""
    clock = Clock()
    own = {"ddtree-16": 0.02, "ddtree-8": 0.01, PLAIN: 0.004}
    chooser = profiled(clock, own, tiers=(4,))
    actual = {name: seconds + 0.02 for name, seconds in own.items()}
    tokens = {"ddtree-16": 4.5, "ddtree-8": 3, PLAIN: 1}
    ran = [run(chooser, clock, 4, actual, tokens) for _ in range(40)]
    assert "ddtree-8" in ran[:10] and ran[-10:] == ["ddtree-16"] * 10
    assert chooser.seconds(PLAIN, 4) == pytest.approx(0.024)  # not run since: today's overhead


def test_a_round_dispatched_behind_another_counts_from_the_others_collection():
    clock = Clock()
    chooser = Chooser(NAMES, clock)
    first, second = chooser.choose(1), chooser.choose(1)  # both dispatched at 0
    assert first.name == second.name == "ddtree-16"  # not measured yet: probed
    clock.now = 0.05
    chooser.collected(first, [2])
    assert chooser.seconds("ddtree-16", 1) == pytest.approx(0.05)
    clock.now = 0.08
    chooser.collected(second, [1])
    assert 0.03 < chooser.seconds("ddtree-16", 1) < 0.05  # towards 30 ms, not 80


def test_rows_that_gave_nothing_do_not_lower_the_estimate():
    chooser = Chooser(NAMES, Clock())
    chooser.collected(chooser.choose(4), [5, 0, 0, 3])
    assert chooser.tokens["ddtree-16"] == 4.0
    chooser.collected(chooser.choose(4), [0, 0, 0, 0])
    assert chooser.tokens["ddtree-16"] == 4.0 and "ddtree-8" not in chooser.tokens


def test_stale_specs_are_probed_once_and_the_choice_kept():
    clock, seconds = Clock(), {"ddtree-16": 0.03, "ddtree-8": 0.02, PLAIN: 0.01}
    tokens = {"ddtree-16": 5, "ddtree-8": 4, PLAIN: 1}
    chooser = profiled(clock, seconds, probe_every=10)
    ran, current = [], []
    for _ in range(60):
        ran.append(run(chooser, clock, 1, seconds, tokens))
        current.append(chooser.current)
    probes = [name for name in ran[9:] if name != "ddtree-8"]
    assert set(probes) == {"ddtree-16", PLAIN}  # plain decoding is never chosen, yet probed
    assert len(probes) <= 2 * 60 // 10
    assert set(current[9:]) == {"ddtree-8"}


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.975, 1.025), min_size=30, max_size=30))
def test_noise_within_the_margin_does_not_flap(noise):
    """Two specs within 1% of each other and timing noise of +-2.5% between rounds (inside the
    5% margin): once both are measured the choice never changes."""
    clock = Clock()
    seconds = {"ddtree-16": 0.0202, "ddtree-8": 0.02, PLAIN: 0.02}
    tokens = {"ddtree-16": 4, "ddtree-8": 4, PLAIN: 1}
    chooser = profiled(clock, seconds, probe_every=1000)
    choices = []
    for factor in noise:
        ticket = chooser.choose(1)
        clock.now += seconds[ticket.name] * factor
        chooser.collected(ticket, [tokens[ticket.name]])
        choices.append(chooser.current)
    assert len(set(choices[9:])) == 1
    assert PLAIN not in choices


def test_a_single_spec_is_always_chosen_and_learns_nothing():
    chooser = Chooser(("dflash-8",), Clock())
    for _ in range(3):
        ticket = chooser.choose(8)
        chooser.collected(ticket, [3] * 8)
        assert ticket.name == "dflash-8"
    assert chooser.base == {} and chooser.tokens == {}
    assert chooser.rounds == {"dflash-8": 3}


def test_rounds_faster_than_their_profile_do_not_make_plain_decoding_free():
    """Rounds dispatched ahead take 60% of their warm-up time: plain decoding's 3 ms becomes 1.8,
    not nothing, and the chooser keeps speculating."""
    clock, own = Clock(), {"ddtree-16": 0.010, "ddtree-8": 0.006, PLAIN: 0.003}
    chooser = profiled(clock, own)
    actual = {name: 0.6 * seconds for name, seconds in own.items()}
    tokens = {"ddtree-16": 4.5, "ddtree-8": 3, PLAIN: 1}
    current = []
    for _ in range(100):
        run(chooser, clock, 1, actual, tokens)
        current.append(chooser.current)
    assert chooser.seconds(PLAIN, 1) == pytest.approx(0.0018)
    assert PLAIN not in current


# A server's numbers (2-core host, one client, 2026-12-07): the warm-up's profile taken while
# three other servers compiled beside it, against the rounds served; DDTree-3 gives the most.
LOGGED = ("ddtree-7", "ddtree-3", PLAIN)
WARM_UP = {"ddtree-7": 0.00574, "ddtree-3": 0.00533, PLAIN: 0.00692}
SERVED = {"ddtree-7": 0.0083, "ddtree-3": 0.0044, PLAIN: 0.0022}  # 501, 677, 455 tokens/s
ACCEPTED = {"ddtree-7": 4.16, "ddtree-3": 2.98, PLAIN: 1}


def logged_chooser(clock: Clock) -> Chooser:
    chooser = Chooser(LOGGED, clock)
    for name in LOGGED:
        profile(chooser, clock, name, 1, WARM_UP[name])
    return chooser


def test_a_profile_taken_on_a_busy_host_gives_way_to_the_rounds_served():
    """The profile alone says DDTree-7 (725 tokens/s against 559 and 145): the rounds served
    say DDTree-3, and the chooser runs it once each is measured."""
    clock = Clock()
    chooser = logged_chooser(clock)
    ran = [run(chooser, clock, 1, SERVED, ACCEPTED) for _ in range(140)]
    assert chooser.current == "ddtree-3"
    assert ran[9:].count("ddtree-3") >= 0.95 * len(ran[9:])


def test_a_host_slowing_every_round_does_not_change_the_choice():
    """Another process takes the cores for 40 rounds: every round runs 4x slower. The time
    every round adds is not the same for every spec (it scales each one's), so the choice
    stays: it does not drift to the spec that gives the most a round."""
    clock = Clock()
    chooser = logged_chooser(clock)
    for _ in range(20):
        run(chooser, clock, 1, SERVED, ACCEPTED)
    busy = {name: 4 * seconds for name, seconds in SERVED.items()}
    current = []
    for times in [busy] * 40 + [SERVED] * 20:
        run(chooser, clock, 1, times, ACCEPTED)
        current.append(chooser.current)
    assert set(current) == {"ddtree-3"}
    assert chooser.load[1] == pytest.approx(1, rel=0.05)  # back once the host is


def test_a_round_behind_a_prefill_times_nothing():
    clock = Clock()
    chooser = logged_chooser(clock)
    for _ in range(20):
        run(chooser, clock, 1, SERVED, ACCEPTED)
    before = {name: chooser.seconds(name, 1) for name in LOGGED}
    ticket = dataclasses.replace(chooser.choose(1), timed=False)
    clock.now += 0.05  # a prompt's prefill, then the round
    chooser.collected(ticket, [3])
    assert {name: chooser.seconds(name, 1) for name in LOGGED} == before
