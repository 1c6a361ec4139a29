"""The plan for a CPU host counts the memory maps a server of its batch and length compiles into
(jaxdd.decoding.memory_maps) and says whether they fit this host's vm.max_map_count; a plan for
a GPU has no such line."""

from __future__ import annotations

from jaxdd.config import DrafterConfig
from jaxdd.decoding.memory_maps import pool_programs, program_sizes
from jaxdd.planning.fit import PlanOptions, plan
from jaxdd.planning.report import maps_report, report

CONFIGS = ("tests/fixtures/kimi_k25_config.json", "tests/fixtures/kimi_k26_dflash_config.json")


def test_a_cpu_plan_counts_its_servers_maps_and_a_gpu_plan_does_not():
    options = {"method": "ddtree", "budget": 8, "batch": 17, "max_len": 2048, "layers": 2}
    result = plan(*CONFIGS, PlanOptions("cpu", 8, compile_round=False, **options))
    drafter_layers = DrafterConfig.from_json_file(CONFIGS[1]).num_hidden_layers
    programs = pool_programs("ddtree", 17, 2047, True, True, None)
    maps = result["memory_maps"]
    assert maps["programs"] == programs.prefills + programs.rounds == 73 + 12
    assert maps["maps"] == programs.maps(program_sizes("ddtree", "cpu", (2, drafter_layers)))
    line = report(result).splitlines()[-1]
    assert line.startswith("memory maps: a server of 17 rows at 2048 tokens compiles 85 programs")
    assert "vm.max_map_count" in line and ("does not fit 90%" in line) != maps["fits"]
    over = maps_report(maps | {"fits": False, "limit": 1000}, 17, 2048)
    assert over[0].endswith("does not fit 90% of this host's vm.max_map_count 1,000")
    gpu = plan(*CONFIGS, PlanOptions("rtx-pro-6000", 8, compile_round=False, **options))
    assert gpu["memory_maps"] is None and "memory maps" not in report(gpu)
