"""The latent cache's layout in the plan (jaxdd.planning.cache_layout, capacity): striped reads
a device's share of the cache and pays the merge's collectives, replicated reads all of it,
the default is the faster floor, and the pages that fit are counted for both layouts."""

from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys

import numpy as np
import pytest

from jaxdd.cache.paging import PAGE_TOKENS, pool_pages
from jaxdd.config import DrafterConfig, KimiConfig
from jaxdd.errors import InputError
from jaxdd.planning import fit
from jaxdd.planning.cache_layout import (
    ALL_TO_ALL,
    GATHER_SCATTER,
    choose_layout,
    latent_row_bytes,
    merge_costs,
    tokens_read,
)
from jaxdd.planning.capacity import cache_capacity
from jaxdd.planning.fit import PlanOptions, plan
from jaxdd.planning.hardware import GPUS
from jaxdd.planning.report import merge_report, report
from jaxdd.planning.roofline import RoundSize
from jaxdd.planning.traffic import (
    ModelBytes,
    PairAccount,
    Spread,
    format_table,
    round_traffic,
    sent_bytes,
)
from jaxdd.types import LAYOUTS, CacheLayout

FIXTURES = "tests/fixtures/"
CONFIGS = (FIXTURES + "kimi_k25_config.json", FIXTURES + "kimi_k26_dflash_config.json")
CLI = [sys.executable, "-m", "jaxdd.plan", "--config", CONFIGS[0], "--drafter-config", CONFIGS[1]]


@functools.cache
def k26_plan(context: int, **options) -> dict:
    """The full K2.6 + DFlash on 8 x RTX PRO 6000, TP, batch 1: the AR traffic account
    (``options``: another round, or layout)."""
    asked = {"hardware": "rtx-pro-6000", "method": "ar", "max_len": context} | options
    return plan(*CONFIGS, PlanOptions(**asked, compile_round=False))


def rows(result: dict, layout: CacheLayout) -> dict[str, dict]:
    return {row["round"]: row for row in result["traffic_by_layout"][layout]}


@pytest.mark.slow
def test_striped_reads_an_eighth_of_the_128k_cache_and_is_the_default_there():
    """At 128k the striped AR round reads under half the replicated bytes (the cache's eighth,
    all else equal), pays 2 collectives per layer for the merge, and the faster floor makes it
    the default; DDTree-16 saves the same cache bytes."""
    result = k26_plan(131072)
    config = KimiConfig.from_json_file(CONFIGS[0])
    striped, replicated = rows(result, "striped"), rows(result, "replicated")
    assert list(striped) == list(replicated)
    cache = 131072 * latent_row_bytes(config)
    for name in ("ar", "ddtree 16"):
        assert replicated[name]["kv"] == cache and striped[name]["kv"] == cache / 8
        for key in ("weights", "experts", "drafter", "allreduce_bytes", "allreduces"):
            assert striped[name][key] == replicated[name][key]
    assert striped["ar"]["read_total"] < 0.5 * replicated["ar"]["read_total"]
    pcie = striped["ar"]["targets"]["rtx-pro-6000"]
    assert pcie["merge"] == ALL_TO_ALL
    assert striped["ar"]["merges"][ALL_TO_ALL]["collectives"] == 2 * config.num_hidden_layers
    assert pcie["round_s"] < replicated["ar"]["targets"]["rtx-pro-6000"]["round_s"]
    assert result["cache_layout"] == "striped" and "AR floor" in result["cache_layout_reason"]
    assert result["traffic"] == result["traffic_by_layout"]["striped"]


@pytest.mark.slow
def test_8k_default_is_the_replicated_account():
    """At 8k the merge's collective latency outweighs the cache reads striping saves on PCIe:
    the default stays replicated and its rows have no merge and read the whole cache."""
    result = k26_plan(8192)
    config = KimiConfig.from_json_file(CONFIGS[0])
    assert result["cache_layout"] == "replicated"
    assert result["traffic"] == result["traffic_by_layout"]["replicated"]
    for row in result["traffic"]:
        assert "merges" not in row and row["kv"] == 8192 * latent_row_bytes(config)
        assert "merge" not in row["targets"]["rtx-pro-6000"]
    striped = rows(result, "striped")["ar"]["targets"]["rtx-pro-6000"]
    replicated = rows(result, "replicated")["ar"]["targets"]["rtx-pro-6000"]
    assert striped["round_s"] > replicated["round_s"]
    latency = 2 * config.num_hidden_layers * GPUS["rtx-pro-6000"].collective_latency
    assert latency > replicated["memory_s"] - striped["memory_s"] > 0


@pytest.mark.slow
def test_asked_layout_is_accounted():
    result = k26_plan(8192, cache_layout="striped")
    assert result["cache_layout"] == "striped" and "as asked" in result["cache_layout_reason"]
    assert result["traffic"] == result["traffic_by_layout"]["striped"]
    assert result["cache_capacity_tokens"] == result["cache_capacity"]["striped"]["tokens"]


@pytest.mark.slow
def test_capacity_counts_whole_pages_and_the_drafter_kv_keeps_it_under_8x():
    """The decode state's own bytes per slot: K2.6's latent rows on every device, the drafter's
    K/V split over 8 devices by its 8 KV heads. The pages fit in the memory left after the
    weights; striped holds more, but less than 8x: the drafter's share is not divided again.
    An AR round's pool holds no drafter K/V (the runtime allocates none)."""
    result = k26_plan(131072, method="dflash")
    assert k26_plan(131072)["cache_capacity"]["slot_bytes"]["drafter"] == 0
    capacity = result["cache_capacity"]
    config = KimiConfig.from_json_file(CONFIGS[0])
    drafter = DrafterConfig.from_json_file(CONFIGS[1])
    drafter_kv = 2 * drafter.num_hidden_layers * drafter.num_key_value_heads * drafter.head_dim
    assert capacity["slot_bytes"] == {"latent": latent_row_bytes(config), "drafter": drafter_kv / 4}
    free = GPUS["rtx-pro-6000"].memory - capacity["weights_bytes"]
    assert capacity["free_bytes"] == free and capacity["activations_bytes"] == 0
    for layout in LAYOUTS:
        held = capacity[layout]
        assert held["tokens"] == held["pages"] * PAGE_TOKENS
        assert held["tokens"] * held["bytes_per_token"] <= free
        # one more page per device would not fit
        group = 8 if layout == "striped" else 1
        assert (held["tokens"] + group * PAGE_TOKENS) * held["bytes_per_token"] > free
    ratio = capacity["striped"]["tokens"] / capacity["replicated"]["tokens"]
    slot = capacity["slot_bytes"]
    explained = (slot["latent"] + slot["drafter"]) / (slot["latent"] / 8 + slot["drafter"])
    assert 1 < ratio < 8 and ratio == pytest.approx(explained, rel=1e-3)
    no_drafter = {"latent": slot["latent"], "drafter": 0}
    full = [cache_capacity(free, no_drafter, 8, layout)["tokens"] for layout in LAYOUTS]
    assert full[0] == pytest.approx(8 * full[1], rel=1e-3)
    assert result["cache_capacity_tokens"] == capacity[result["cache_layout"]]["tokens"]
    assert f"({ratio:.2f}x: striping divides the latent rows" in report(result)


@pytest.mark.slow
def test_the_drafter_kv_in_fp8_takes_half_its_bytes_and_striping_passes_7x():
    """``--drafter-kv fp8``: the drafter's K/V takes half its bytes per token, in the capacity and
    in the floor (a DFlash round reads half its context K/V); striped, the pages hold over 7x the
    context tokens of today's replicated rows (the drafter's K/V in bf16)."""
    today = k26_plan(131072, method="dflash")
    fp8 = k26_plan(131072, method="dflash", drafter_kv="fp8")
    slot, halved = today["cache_capacity"]["slot_bytes"], fp8["cache_capacity"]["slot_bytes"]
    assert halved == {"latent": slot["latent"], "drafter": slot["drafter"] / 2}
    for layout in LAYOUTS:
        kv = [rows(result, layout)["dflash"]["drafter_kv"] for result in (today, fp8)]
        assert kv[1] * 2 == kv[0] > 0
    striped = fp8["cache_capacity"]["striped"]["tokens"]
    assert striped > 7 * today["cache_capacity"]["replicated"]["tokens"]


@pytest.mark.parametrize("devices", [2, 3, 8])
def test_tokens_read_is_the_busiest_devices_pages(devices):
    """Pages dealt round-robin, counted one by one: the busiest device's rows."""
    rng = np.random.default_rng(devices)
    for context in [1, 63, 64, 65, *rng.integers(1, 20000, 20).tolist()]:
        held = [0] * devices
        for page, start in enumerate(range(0, context, PAGE_TOKENS)):
            held[page % devices] += min(PAGE_TOKENS, context - start)
        assert tokens_read(context, devices, "striped") == max(held)
        assert tokens_read(context, devices, "replicated") == context
    assert tokens_read(5000, 1, "striped") == 5000


@pytest.mark.parametrize(("tokens", "devices"), [(1, 2), (17, 8), (65, 4)])
def test_all_to_all_merge_sends_less_in_fewer_collectives(tokens, devices):
    """One all-to-all carries the log-sum-exps with the outputs: fewer bytes than gathering
    every device's log-sum-exps, and one collective per layer less."""
    config = KimiConfig.from_json_file(CONFIGS[0])
    costs = merge_costs(config, tokens, devices)
    assert costs[ALL_TO_ALL]["bytes"] < costs[GATHER_SCATTER]["bytes"]
    assert (
        costs[ALL_TO_ALL]["collectives"] + config.num_hidden_layers
        == (costs[GATHER_SCATTER]["collectives"])
    )
    assert merge_costs(config, tokens, 1) == {}


def test_choice_follows_capacity_then_the_floor():
    h200 = GPUS["h200"]
    floors = {"striped": 2.0, "replicated": 1.0}
    fits = {"striped": 800, "replicated": 100}
    choose = lambda needed, hardware=h200, devices=8: (
        choose_layout(None, floors, fits, needed, hardware, devices, "AR").layout
    )
    assert choose(100) == "replicated"  # both hold it: the faster floor
    assert choose(101) == "striped"  # only striped holds it
    assert choose(801) == "replicated"  # neither: the faster floor again
    assert choose(101, devices=1) == "replicated"
    assert choose(100, hardware=None) == "replicated"  # the CPU: no link model
    with pytest.raises(InputError, match="--cache-layout"):
        PlanOptions(cache_layout="interleaved")


@pytest.mark.slow
def test_command_line_json_and_a_bad_layout():
    """`--json` carries the layout, its reason, both capacities and both layouts' rounds;
    a layout or MoE split that does not exist is one line naming the flag and exit 2
    (2 layers, full width)."""
    argv = [*CLI, "--layers", "2", "--traffic", "--hardware", "rtx-pro-6000", "--method", "ar"]
    run = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    for key in ("cache_layout", "cache_layout_reason", "cache_capacity_tokens", "cache_capacity"):
        assert key in result
    assert set(result["traffic_by_layout"]) == set(LAYOUTS)
    layout = result["cache_layout"]
    assert result["cache_capacity_tokens"] == result["cache_capacity"][layout]["tokens"]
    names = [[row["round"] for row in rounds] for rounds in result["traffic_by_layout"].values()]
    assert names[0] == names[1] == [row["round"] for row in result["traffic"]]
    for flag, value in (("--cache-layout", "interleaved"), ("--moe", "dp")):
        bad = subprocess.run([*argv, flag, value], capture_output=True, text=True, timeout=300)
        assert bad.returncode == 2 and bad.stdout == ""
        (line,) = bad.stderr.strip().splitlines()
        assert line.startswith(f"jaxdd: argument {flag}: invalid choice: '{value}'")


TINY_ROUND = PlanOptions("cpu", 8, method="ar", batch=4, max_len=4096)


@functools.cache
def tiny_plan(configs: tuple, layout: CacheLayout) -> dict:
    """The tiny pair's AR round, 4 rows of 4096 tokens on 8 CPU devices, compiled in ``layout``."""
    return plan(*configs, dataclasses.replace(TINY_ROUND, cache_layout=layout))


def cache_reads(result: dict, buffers: str) -> list[int]:
    """Per layer, the compiled round's reads of the target's ``latent`` or ``rope`` rows."""
    reads = result["compiled_traffic"]["by_weight"]
    return [reads[f"state.target_cache.{buffers}[{i}]"] for i in range(result["layers"])]


@pytest.mark.slow
def test_the_striped_round_holds_and_reads_a_device_share_of_the_cache(tiny_plan_configs):
    """The plan compiles the round in its layout: striped, the state's latent buffers are split
    along slots (a multiple of a page per device), so a device stores an eighth of the rows
    and its attention reads only those (at most twice: the absorbed form's scores and values
    on XLA:CPU), against the striped floor: an eighth of the cache, plus the merge."""
    replicated, striped = (tiny_plan(tiny_plan_configs, name) for name in LAYOUTS[::-1])
    slots = striped["cache_slots"]
    assert slots % (8 * PAGE_TOKENS) == 0 and slots >= replicated["cache_slots"] >= 4096 + 1
    # the rows' int32 lengths and page tables, replicated
    rows = lambda result: 4 * 4 + 4 * 4 * result["cache_slots"] // PAGE_TOKENS
    pool = lambda result, devices: pool_pages(4 * result["cache_slots"], PAGE_TOKENS, devices)
    cache = replicated["per_device_bytes"]["target_cache"] - rows(replicated)
    share = cache / pool(replicated, 1) * pool(striped, 8) / 8  # its pages, a null one among them
    assert striped["per_device_bytes"]["target_cache"] - rows(striped) == share
    for buffers in ("latent", "rope"):
        whole = cache_reads(replicated, buffers)
        for read, full in zip(cache_reads(striped, buffers), whole, strict=True):
            assert full / 8 <= read <= 2 * full / 8
    floors = [r["compiled_traffic"]["floor"] for r in (replicated, striped)]
    assert floors[1]["kv"] == floors[0]["kv"] / 8
    assert floors[0]["merge_bytes"] == 0 < floors[1]["merge_bytes"]
    assert floors[1]["merge_collectives"] == 2 * replicated["layers"]  # the all-to-all's
    account = striped["compiled_traffic"]
    assert account["ratio"] == round(account["bytes"] / account["floor_bytes"], 3)
    assert account["bytes"] < replicated["compiled_traffic"]["bytes"] / 2


def test_the_verdict_follows_the_layout(tiny_plan_configs, monkeypatch):
    """A batch whose replicated latent rows overflow each device's memory but whose striped
    pages fit: striped holds its eighth of each row (an AR round: no drafter K/V) and fits,
    replicated does not. The default: both hold the batch in the memory after the weights, so
    it compiles the replicated round, whose temporaries leave only striped holding it: it
    compiles the striped round too and reports that one."""
    replicated = tiny_plan(tiny_plan_configs, "replicated")
    per_device = replicated["per_device_bytes"]
    # between the replicated total and the striped one (an eighth of the cache)
    memory = per_device["total"] - per_device["target_cache"] / 2
    real = fit.find_machine
    monkeypatch.setattr(
        fit,
        "find_machine",
        lambda *a: dataclasses.replace(real(*a), memory=memory),
    )
    results = {
        layout: plan(*tiny_plan_configs, dataclasses.replace(TINY_ROUND, cache_layout=layout))
        for layout in (*LAYOUTS, None)
    }
    assert not results["replicated"]["fits"]
    assert results["replicated"]["per_device_bytes"] == per_device
    assert "does not fit cpu" in report(results["replicated"])
    striped = results["striped"]
    rows = striped["per_device_bytes"]
    assert rows == tiny_plan(tiny_plan_configs, "striped")["per_device_bytes"]
    slots = striped["cache_slots"], replicated["cache_slots"]
    assert slots[0] % (8 * PAGE_TOKENS) == 0 and 0 <= slots[0] - slots[1] < 8 * PAGE_TOKENS
    assert rows["drafter_cache"] == per_device["drafter_cache"] == 0  # as the runtime's AR
    assert rows["total"] == sum(v for k, v in rows.items() if k != "total") <= memory
    assert striped["fits"] and "\nfits cpu" in report(striped)
    assert "(striped over 8 devices: one page in 8 on each)" in report(striped)
    default = results[None]
    held = results["replicated"]["cache_capacity"]["replicated"]["tokens"]
    assert default["cache_layout"] == "striped"
    assert f"replicated rows hold {held:,} context tokens" in default["cache_layout_reason"]
    assert default["fits"] and default["per_device_bytes"] == rows
    assert default["cache_capacity"]["activations_bytes"] == rows["temporaries"]


@pytest.mark.slow
def test_the_default_weighs_the_floors_at_the_plans_batch():
    """Striping saves each row's cache reads, but its merge's collectives are paid once per
    round: at 64k on PCIe one row's round is faster replicated, two rows' striped (both
    layouts hold the 2 x 64k tokens, so the floors decide)."""
    one, two = k26_plan(65536), k26_plan(65536, batch=2)
    assert one["cache_layout"] == "replicated" and "AR floor" in one["cache_layout_reason"]
    assert two["cache_layout"] == "striped"
    assert "AR (batch 2) floor" in two["cache_layout_reason"]
    capacity = two["cache_capacity"]
    assert capacity["replicated"]["tokens"] >= 2 * 65536
    # the tables stay one row's round
    assert two["traffic_by_layout"] == one["traffic_by_layout"]


def test_a_batchs_round_reads_the_weights_once_and_each_rows_cache():
    config = KimiConfig.from_json_file(CONFIGS[0])
    model = ModelBytes(1000, 10, 7, 5000, 300, 60, 1, 1, 3)
    rounds = {
        batch: round_traffic(
            RoundSize(9, 4096, 8, batch), PairAccount(config, model), Spread(8, "tp", "striped")
        )
        for batch in (1, 3)
    }
    one, three = rounds[1], rounds[3]
    assert three["kv"] == 3 * one["kv"] == 3 * tokens_read(4096, 8, "striped") * 70272
    assert three["drafter"] == one["drafter"]
    assert three["drafter_kv"] == 3 * one["drafter_kv"] == 3 * 4096 * 3
    assert three["weights"] - one["weights"] == 2 * 9 * 7
    assert three["allreduce_bytes"] == 3 * one["allreduce_bytes"]
    assert three["allreduces"] == one["allreduces"]
    assert three["merges"] == merge_costs(config, 27, 8)
    assert three["experts_read"] > one["experts_read"]


def test_sent_column_and_merge_lines_say_what_the_link_time_counts():
    """The table's MB sent are the bytes its link ms carry (all-reduces, and a striped round's
    merge); each merge scheme chosen gets its own line with its own collectives and bytes."""
    result = k26_plan(131072)
    striped = result["traffic_by_layout"]["striped"]
    for row in striped:
        for key, hardware in GPUS.items():
            floor = row["targets"][key]
            sent = sent_bytes(row, floor["merge"])
            collectives = row["allreduces"] + row["merges"][floor["merge"]]["collectives"]
            link = sent / hardware.link + collectives * hardware.collective_latency
            assert floor["link_s"] == pytest.approx(link)
    table = format_table(striped).splitlines()
    assert table[1].strip().startswith("(all-reduces + merge) |")
    ar = striped[0]
    assert table[2].split()[4] == f"{sent_bytes(ar, ALL_TO_ALL) / 1e6:.2f}"
    assert "(all-reduces) |" in format_table(result["traffic_by_layout"]["replicated"])
    (line,) = merge_report(striped)
    assert "merge by all-to-all (the link model's choice on every GPU), 122 collectives" in line
    # the link model picked the gather + reduce-scatter on H200 for one row
    mixed = [dict(row, targets=dict(row["targets"])) for row in striped]
    mixed[0]["targets"]["h200"] = mixed[0]["targets"]["h200"] | {"merge": GATHER_SCATTER}
    gather, a2a = merge_report(mixed)
    assert "all-to-all (the link model's choice on every GPU), 122 collectives" in a2a
    assert "all-gather + reduce-scatter (the link model's choice on 8 x H200" in gather
    assert "183 collectives" in gather
    sent = striped[0]["merges"][GATHER_SCATTER]["bytes"] / 1e6
    assert gather.split("MB sent per round: ")[1].startswith(f"{sent:.1f} / ")
    low, high = sorted(sent_bytes(striped[0], m) / 1e6 for m in (ALL_TO_ALL, GATHER_SCATTER))
    assert format_table(mixed).splitlines()[2].split()[4] == f"{low:.0f}-{high:.0f}"
