"""The latent cache's layout a run takes by default (jaxdd.planning.default_layout): the plan's
choice for the loaded models on their devices, replicated where there is nothing to weigh."""

from __future__ import annotations

import pytest

import jaxdd
from jaxdd.planning import default_layout as layouts
from jaxdd.planning.fit import PlanOptions, plan
from jaxdd.planning.hardware import GPUS
from jaxdd.testing.reference import SHARDABLE_DRAFTER, SHARDABLE_K2, save_random_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A shardable random pair saved once, and loaded bf16 over 8 simulated devices (TP)."""
    directories = save_random_pair(
        tmp_path_factory.mktemp("layout"), SHARDABLE_K2, SHARDABLE_DRAFTER, seed=3
    )
    return directories, jaxdd.load_pair(*directories, "bfloat16", 8, "tp")


def test_simulated_devices_and_one_device_stay_replicated(pair):
    directories, (target, drafter) = pair
    eight = layouts.default_layout(target.model, drafter, "ddtree", 1 << 17, budget=16)
    assert eight.layout == "replicated" and "no link model" in eight.reason
    one_target, one_drafter = jaxdd.load_pair(*directories, "bfloat16")
    one = layouts.default_layout(one_target.model, one_drafter, "dflash", 1 << 17, 4)
    assert one.layout == "replicated" and "one device" in one.reason


def test_on_named_hardware_the_run_takes_the_plans_layout(pair, monkeypatch):
    """The devices taken for 8 H200s: the layout and reason (both floors, to the microsecond)
    are the plan's for the same configs, rounds and context; both layouts come up."""
    (target_dir, drafter_dir), (target, drafter) = pair
    monkeypatch.setattr(layouts, "hardware_of", lambda device: GPUS["h200"])
    chosen = set()
    for method, max_len, batch in (
        ("ddtree", 4096, 1),
        ("ar", 1 << 20, 64),
        ("dflash", 1 << 20, 16),
    ):
        run = layouts.default_layout(target.model, drafter, method, max_len, batch, budget=16)
        options = PlanOptions(
            hardware="h200",
            method=method,
            budget=16,
            max_len=max_len,
            batch=batch,
            compile_round=False,
        )
        planned = plan(target_dir / "config.json", drafter_dir / "config.json", options)
        assert (run.layout, run.reason) == (planned["cache_layout"], planned["cache_layout_reason"])
        chosen.add(run.layout)
    assert chosen == {"replicated", "striped"}
