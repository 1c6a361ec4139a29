"""The traffic account (jaxdd.planning.traffic): distinct
experts, bytes per round, and the plan's table."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxdd.planning.fit import PlanOptions, plan
from jaxdd.planning.hardware import GPUS
from jaxdd.planning.report import report
from jaxdd.planning.traffic import distinct_experts, slowest_device_experts
from jaxdd.testing.server import START_SECONDS


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tokens", "top_k", "experts"), [(1, 8, 384), (16, 8, 128), (65, 8, 384), (9, 2, 16)]
)
def test_distinct_experts_matches_sampled_routing(tokens, top_k, experts):
    """E (1 - (1 - k/E)^T) against tokens that each pick k distinct experts at random; a
    histogram of equal probabilities k/E gives the same; one token reads exactly k."""
    rng = np.random.default_rng([tokens, top_k, experts])
    keys = rng.random((4000, tokens, experts))
    chosen = np.argsort(keys, axis=-1)[..., :top_k].reshape(4000, -1)
    sampled = np.mean([len(np.unique(row)) for row in chosen])
    expected = distinct_experts(tokens, top_k, experts)
    assert abs(sampled - expected) < 0.02 * expected + 0.05
    assert distinct_experts(
        tokens, top_k, experts, np.full(experts, top_k / experts)
    ) == pytest.approx(expected)
    assert distinct_experts(1, top_k, experts) == pytest.approx(top_k)


def test_skewed_routing_reads_fewer_experts_and_ep_waits_for_its_busiest_device():
    # 8 favourites take 90% of the choices
    skewed = np.r_[np.full(8, 0.9), np.full(120, (8 - 7.2) / 120)]
    assert distinct_experts(16, 8, 128, skewed) < 0.5 * distinct_experts(16, 8, 128)
    for tokens in (1, 16, 65):
        mean_local = distinct_experts(tokens, 8, 384) / 8
        busiest = slowest_device_experts(tokens, 8, 384, 8)
        assert mean_local < busiest <= min(48, 8 * tokens)


def test_plan_traffic_table():
    """The plan's traffic account of K2.6's width on 8 devices (no compile): per round
    the bytes grow with the verified tokens, tokens/s is tau over the floor, PCIe's
    link costs more than NVLink's, and AR reads exactly its top-8 experts' worth."""
    fixtures = "tests/fixtures/"
    configs = (fixtures + "kimi_k25_config.json", fixtures + "kimi_k26_dflash_config.json")
    result = plan(
        *configs, PlanOptions(devices=8, moe="tp", layers=3, compile_round=False)
    )  # full width; depth only scales the bytes
    rows = result["traffic"]
    assert [r["round"] for r in rows] == [
        "ar",
        "dflash",
        "ddtree 4",
        "ddtree 8",
        "ddtree 16",
        "ddtree 32",
        "ddtree 64",
    ]
    ar = rows[0]
    assert ar["experts_read"] == pytest.approx(8) and ar["drafter"] == ar["drafter_kv"] == 0
    # the drafter reads its context's K/V: per token, its 8 KV heads of 128 over 8 devices,
    # K and V in bf16, in each of its layers
    drafter = json.loads(Path(configs[1]).read_text())
    per_token = drafter["num_hidden_layers"] * 2 * (8 // 8) * 128 * 2
    assert all(row["drafter_kv"] == result["max_len"] * per_token for row in rows[1:])
    trees = rows[2:]
    assert all(a["read_total"] < b["read_total"] for a, b in itertools.pairwise(trees))
    for row in rows:
        for name, target in row["targets"].items():
            assert target["tokens_per_s"] == pytest.approx(row["tau"] / target["round_s"])
            assert target["memory_s"] == pytest.approx(row["read_total"] / GPUS[name].bandwidth)
        assert row["targets"]["rtx-pro-6000"]["link_s"] > row["targets"]["h200"]["link_s"]
    assert "tokens/s" in report(result) and "per device:" not in report(result)


def test_plan_command_line_traffic_only():
    """`python -m jaxdd.plan --traffic`: the table without compiling (2
    layers at full width, a fresh process for its 8 simulated devices)."""
    argv = [sys.executable, "-m", "jaxdd.plan", "--config", "tests/fixtures/kimi_k25_config.json"]
    argv += [
        "--drafter-config",
        "tests/fixtures/kimi_k26_dflash_config.json",
        "--layers",
        "2",
        "--traffic",
    ]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=START_SECONDS)
    assert run.returncode == 0, run.stderr
    assert (
        "ddtree 64" in run.stdout
        and "8 x RTX PRO 6000 (PCIe)" in run.stdout
        and "compiled in" not in run.stdout
    )
