"""The latent cache's layout a run takes by default (jaxdd.planning.default_layout): the plan's
choice for the loaded models on their devices, replicated where there is nothing to weigh."""

from __future__ import annotations

import pytest

import jaxdd
from jaxdd.planning import default_layout as layouts
from jaxdd.planning.capacity import CACHE_MEMORY_FRACTION, slot_bytes
from jaxdd.planning.default_layout import RunRound
from jaxdd.planning.fit import PlanOptions, plan
from jaxdd.planning.hardware import GPUS
from jaxdd.runtime.sharding import mesh_of
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
    eight = layouts.default_layout(target.model, drafter, RunRound("ddtree", 1 << 17, budget=16))
    assert eight.layout == "replicated" and "no link model" in eight.reason
    one_target, one_drafter = jaxdd.load_pair(*directories, "bfloat16")
    one = layouts.default_layout(one_target.model, one_drafter, RunRound("dflash", 1 << 17, 4))
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
        asked = RunRound(method, max_len, batch, budget=16)
        run = layouts.default_layout(target.model, drafter, asked)
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


def test_the_runs_own_round_and_memory_decide(pair, monkeypatch):
    """Without a budget the round weighed is the one the run takes (block - 1 nodes), not the
    plan's default of 64; where only striped pages hold the rows in the devices' free memory,
    striped whatever the floors (the allocators' least over the processes)."""
    _, (target, drafter) = pair
    monkeypatch.setattr(layouts, "hardware_of", lambda device: GPUS["h200"])
    block = drafter.config.block_size
    run = layouts.default_layout(target.model, drafter, RunRound("ddtree", 4096))
    assert f"DDTree-{block - 1} floor on 8 x H200" in run.reason
    slot = slot_bytes(target.config, drafter.config, mesh_of(target.model), target.dtype)
    # room for 4096 tokens striped, not replicated
    free = 4096 * (slot["latent"] / 8 + slot["drafter"]) / CACHE_MEMORY_FRACTION * 1.01
    monkeypatch.setattr(layouts, "least_free_bytes", lambda mesh: free)
    tight = layouts.default_layout(target.model, drafter, RunRound("ddtree", 4096))
    assert tight.layout == "striped" and tight.reason.startswith("replicated rows hold")
