"""A configuration's programs against the memory maps Linux allows a process: the count from its
flags against what a pool's warm-up compiles, the table's maps per program never under what this
host's compiles take, and the one-line refusal past the limit (in-process, and as the server says
it at start-up, before it loads any weight)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

import jaxdd
from jaxdd.cli import DEMO
from jaxdd.config import DrafterConfig, KimiConfig
from jaxdd.decoding import memory_maps
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.decoding.rows import RowPool
from jaxdd.runtime.compile_time import compile_clock
from jaxdd.testing.server import free_port

LINUX = memory_maps.LIMIT_FILE.exists()
LAYERS = (
    KimiConfig.from_json_file(DEMO / "target" / "config.json").num_hidden_layers,
    DrafterConfig.from_json_file(DEMO / "drafter" / "config.json").num_hidden_layers,
)
OPTIONS = {"rows": 2, "max_len": 128, "max_prompt": 80, "max_logprobs": 2}


@pytest.fixture(scope="module")
def pool():
    decoder = SpeculativeDecoder(*jaxdd.load_pair(DEMO / "target", DEMO / "drafter", "float32"))
    return RowPool.serving(decoder, method="dflash", prefix_cache=True, **OPTIONS)


def test_the_count_from_the_flags_is_what_the_pool_warms_up(pool):
    """Prefills (5 buckets x scoring or not, a page's hit, and a rest after it per bucket) and
    rounds (2 tiers x sampled and greedy, and the pool's own), counted without the pool."""
    programs = memory_maps.pool_programs("dflash", 2, 80, True, True, None)
    assert pool.shape.buckets() == [16, 32, 48, 64, 80]
    assert len(pool.shape.warm_up_requests(True)) == programs.prefills == 5 * 2 + 1 + 5
    assert programs.rounds == 2 * len(pool.shape.tiers) + memory_maps.OWN_PROGRAMS == 8
    unscored = memory_maps.pool_programs("dflash", 2, 80, False, False, 40)
    assert unscored.prefills == 5 + 1  # a prompt past one chunk


@pytest.mark.skipif(not LINUX, reason="no /proc/sys/vm/max_map_count here")
@pytest.mark.slow
def test_the_table_covers_what_the_warm_up_maps(pool):
    """The table's maps per program are never under this host's (the pool's longest prefill and
    full round, each compiled), and the warm-up compiles no more programs than counted and maps
    no more than the count times the table's sizes."""
    sizes = memory_maps.program_sizes("dflash", "cpu", LAYERS)
    measured = memory_maps.program_maps(pool)
    assert 0 < measured[0] <= sizes[0] and 0 < measured[1] <= sizes[1]
    programs = memory_maps.pool_programs("dflash", 2, 80, True, True, None)
    before = memory_maps.maps_in_use()
    with compile_clock() as clock:
        pool.warm_up()
    taken = memory_maps.maps_in_use() - before
    assert clock.count <= programs.prefills + programs.rounds
    assert 0 < taken <= programs.maps(sizes)


def test_the_issues_configuration_fits_linuxs_default_limit():
    """DDTree-8, 17 rows, --max-len 2048 (serves, 47,742 maps at most): its estimate fits 90%
    of 65,530; --max-len 4096 does not; a server of the plan's shape says the same."""
    issue = memory_maps.pool_programs("ddtree", 17, 2047, True, True, None)
    assert (issue.prefills, issue.rounds) == (73, 12)
    needed = issue.maps(memory_maps.program_sizes("ddtree", "cpu", LAYERS))
    assert 47_742 < needed <= memory_maps.HEADROOM * 65_530
    longer = memory_maps.pool_programs("dflash", 17, 4095, True, True, None)
    assert (
        longer.maps(memory_maps.program_sizes("dflash", "cpu", LAYERS))
        > memory_maps.HEADROOM * 65_530
    )
    assert memory_maps.server_maps("ddtree", 17, 2048, LAYERS, "gpu") is None
    planned = memory_maps.server_maps("ddtree", 17, 2048, LAYERS, "cpu")
    assert planned["programs"] == 73 + 12 and planned["maps"] == needed


@pytest.mark.skipif(not LINUX, reason="no /proc/sys/vm/max_map_count here")
def test_a_configuration_past_the_limit_is_refused_in_one_line(tmp_path, monkeypatch):
    programs = memory_maps.pool_programs("dflash", 2, 80, True, True, None)
    memory_maps.check_maps(programs, "cpu", LAYERS, "fewer flags")  # this host's limit holds it
    low = tmp_path / "max_map_count"
    low.write_text(f"{memory_maps.maps_in_use() + 100}\n")
    monkeypatch.setattr(memory_maps, "LIMIT_FILE", low)
    memory_maps.check_maps(programs, "gpu", LAYERS, "fewer flags")  # its code is on the device
    with pytest.raises(jaxdd.InputError) as refused:
        memory_maps.check_maps(programs, "cpu", LAYERS, "fewer flags")
    message = str(refused.value)
    assert "\n" not in message and "vm.max_map_count" in message and "fewer flags" in message


@pytest.mark.skipif(not LINUX, reason="no /proc/sys/vm/max_map_count here")
def test_the_server_refuses_a_pool_past_the_limit_before_it_loads_weights(tmp_path):
    """--max-len 4096, 17 rows, every kind of prefill: ~97 programs, past the limit on XLA:CPU.
    The checkpoints hold the demo pair's configs and no weights: the server refuses from the
    configs alone, in one line, exit 2 (it died mid-compile, with no line, before)."""
    for model in ("target", "drafter"):
        (tmp_path / model).mkdir()
        shutil.copy(DEMO / model / "config.json", tmp_path / model)
    argv = [sys.executable, "-m", "jaxdd.serve", "--host", "127.0.0.1", "--port", str(free_port())]
    models = ["--checkpoint", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter")]
    run = subprocess.run(
        [*argv, *models, "--max-len", "4096", "--max-batch", "17"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in run.stderr.splitlines() if line.startswith("jaxdd:")]
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert len(lines) == 1 and "vm.max_map_count" in lines[0] and "--prefill-chunk" in lines[0]


@pytest.mark.skipif(not LINUX, reason="no /proc/sys/vm/max_map_count here")
def test_the_server_counts_every_round_of_an_auto_set(tmp_path):
    """The issue's configuration fits with one DDTree budget (55,540 maps) and not with auto's
    three rounds (70,804): refused from the configs alone, naming the fixed budget."""
    assert memory_maps.pool_programs("ddtree", 17, 2047, True, True, None, 3).rounds == 28
    for model in ("target", "drafter"):
        (tmp_path / model).mkdir()
        shutil.copy(DEMO / model / "config.json", tmp_path / model)
    argv = [sys.executable, "-m", "jaxdd.serve", "--host", "127.0.0.1", "--port", str(free_port())]
    models = ["--checkpoint", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter")]
    shape = ["--max-len", "2048", "--max-batch", "17", "--method", "ddtree", "--budget", "auto"]
    run = subprocess.run([*argv, *models, *shape], capture_output=True, text=True, timeout=300)
    lines = [line for line in run.stderr.splitlines() if line.startswith("jaxdd:")]
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert len(lines) == 1 and "vm.max_map_count" in lines[0] and "--budget" in lines[0]
