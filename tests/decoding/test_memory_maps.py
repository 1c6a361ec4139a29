"""A pool's programs against the memory maps Linux allows a process: the count a pool's warm-up
compiles, the estimate never under what the warm-up takes, and the one-line refusal past the limit
(in-process, and as the server says it at start-up)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import jaxdd
from jaxdd.cli import DEMO
from jaxdd.decoding import memory_maps
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.decoding.rows import RowPool
from jaxdd.runtime.compile_time import compile_clock
from jaxdd.testing.server import free_port

LINUX = memory_maps.LIMIT_FILE.exists()


@pytest.fixture(scope="module")
def pool():
    decoder = SpeculativeDecoder(*jaxdd.load_pair(DEMO / "target", DEMO / "drafter", "float32"))
    options = {"rows": 2, "max_len": 128, "max_prompt": 80, "max_logprobs": 2}
    return RowPool(decoder, method="dflash", prefix_cache=True, **options)


@pytest.mark.skipif(not LINUX, reason="no /proc/sys/vm/max_map_count here")
def test_the_estimate_covers_what_the_warm_up_maps(pool):
    """Prefills (5 buckets x scoring or not, a page's hit, and a rest after it per bucket) and
    rounds (2 tiers x sampled and greedy, and the pool's own): the warm-up compiles no more
    programs than counted, and maps no more than the count times its largest of each kind."""
    prefills, rounds = memory_maps.pool_programs(pool)
    assert pool.shape.buckets() == [16, 32, 48, 64, 80]
    assert (prefills, rounds) == (5 * 2 + 1 + 5, 2 * 2 + memory_maps.OWN_PROGRAMS)
    per_prefill, per_round = memory_maps.program_maps(pool)
    assert 0 < per_prefill <= per_round  # a round drafts, verifies and commits
    before = memory_maps.maps_in_use()
    with compile_clock() as clock:
        pool.warm_up()
    taken = memory_maps.maps_in_use() - before
    assert clock.count <= prefills + rounds
    assert 0 < taken <= prefills * per_prefill + rounds * per_round


@pytest.mark.skipif(not LINUX, reason="no /proc/sys/vm/max_map_count here")
def test_a_pool_past_the_limit_is_refused_in_one_line(pool, tmp_path, monkeypatch):
    memory_maps.check_pool_maps(pool, "fewer flags")  # this host's limit holds it
    low = tmp_path / "max_map_count"
    low.write_text(f"{memory_maps.maps_in_use() + 100}\n")
    monkeypatch.setattr(memory_maps, "LIMIT_FILE", low)
    with pytest.raises(jaxdd.InputError) as refused:
        memory_maps.check_pool_maps(pool, "fewer flags")
    message = str(refused.value)
    assert "\n" not in message and "vm.max_map_count" in message and "fewer flags" in message


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="no /proc/sys/vm/max_map_count here")
def test_the_server_refuses_a_pool_past_the_limit_before_it_compiles_it():
    """--max-len 4096 with every kind of prefill: ~85 programs, past the limit on XLA:CPU; the
    server says so in one line and exits 2 (it died mid-compile, no line, before)."""
    argv = [sys.executable, "-m", "jaxdd.serve", "--host", "127.0.0.1", "--port", str(free_port())]
    run = subprocess.run(
        [*argv, "--max-len", "4096", "--max-batch", "17"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in run.stderr.splitlines() if line.startswith("jaxdd:")]
    assert run.returncode == 2, run.stderr[-2000:]
    assert len(lines) == 1 and "vm.max_map_count" in lines[0] and "--prefill-chunk" in lines[0]
