"""Test setup: CPU only, 8 simulated devices (set before
JAX initialises its backends), and compiles made cheap.

The suite is bound by XLA compiles of tiny models, not by running them: LLVM's optimisation
passes are skipped (about a third of the suite's time; the programs are the same, their
machine code slower), XLA:CPU emits fusions with its loop emitters rather than its MLIR fusion
emitters (the same HLO, compiled in about a quarter less time: tests/README.md), and compiled
programs are shared through a persistent cache among the xdist workers and the CLI subprocesses
of one run (a directory per run, removed at its end).
"""

import gc
import json
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    " --xla_cpu_use_fusion_emitters=false",
)
# Set by the controller before its workers start: they
# inherit it, and so do the subprocesses tests start.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", str(Path(tempfile.gettempdir()) / f"jaxdd-compiles-{os.getpid()}")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")


import jaxdd.runtime.startup  # noqa: I001  (first: JAX without the CUDA plugin's start-up lines)
import jaxdd
import jax
import jax.numpy as jnp
import pytest
import xdist
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.weights.hf_loader import load_hf_drafter
from jaxdd.testing import profiles
from jaxdd.testing.reference import TINY_K2, TINY_K25, drafter_config, hf_drafter, hf_model

profiles.load()


# Seconds each file cost in the profile of tests/README.md, for the order the workers get them.
COSTS = json.loads((Path(__file__).parent / "durations.json").read_text())


@pytest.hookimpl(trylast=True)  # after pytest groups tests by their fixtures
def pytest_collection_modifyitems(session, items):
    """Under xdist the files go to the workers costliest first (the controller hands them out
    in the order its workers collected), so that the two finish together: handed out last, a
    costly file runs alone. A file the profile lacks counts as costliest, so that a new slow
    one cannot end up alone at the end. xdist's own order of files, by count of tests, is off
    (``--no-loadscope-reorder`` in pyproject.toml)."""
    if xdist.is_xdist_worker(session):
        items.sort(key=lambda item: -COSTS.get(item.nodeid.split("::")[0], float("inf")))


def pytest_unconfigure(config):
    cache = Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    # this process made it: the controller, after its workers
    if cache.name == f"jaxdd-compiles-{os.getpid()}":
        shutil.rmtree(cache, ignore_errors=True)


def near_map_limit() -> bool:
    """Whether this process holds over half the memory maps Linux allows it (False elsewhere)."""
    limit = Path("/proc/sys/vm/max_map_count")
    if not limit.exists():
        return False
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps) > int(limit.read_text()) // 2


@pytest.fixture(autouse=True)
def drop_compiled_programs_near_map_limit():
    """After a test, a worker past half the kernel's memory maps per process drops its
    compiled programs: XLA:CPU maps hundreds of regions per executable, and a worker that
    reached the limit (65530) segfaulted mid-compile (checked after each module, one worker
    went from under half to the limit inside tests/decoding/test_prefill_parts.py)."""
    yield
    if near_map_limit():
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session", params=[0, 1], ids=["seed0", "seed1"])
def models(request, tmp_path_factory):
    """A tiny HF target + DFlash drafter pair, and the same weights loaded into jaxdd."""
    seed = request.param
    target_config = TINY_K2 if seed == 0 else TINY_K25
    ref_target = hf_model(target_config, seed)
    ref_drafter = hf_drafter(drafter_config(yarn=seed == 1), seed)
    root = tmp_path_factory.mktemp(f"pair{seed}")
    ref_target.save_pretrained(root / "target")
    ref_drafter.save_pretrained(root / "drafter")
    target = jaxdd.load_target(root / "target", dtype="float32")
    drafter = load_hf_drafter(root / "drafter", jnp.float32)
    return ref_target, ref_drafter, SpeculativeDecoder(target, drafter)


@pytest.fixture(scope="session")
def tiny_plan_configs(tmp_path_factory) -> tuple[Path, Path]:
    """Config files of a tiny Kimi K2.6-style pair for ``jaxdd.plan``: K2.6's
    own config (nested text_config, INT4 routed experts as compressed-tensors)
    at TINY_K2's sizes, and a DFlash drafter of block 8."""
    root = tmp_path_factory.mktemp("plan_configs")
    k26 = json.loads(Path("tests/fixtures/kimi_k25_config.json").read_text())
    k26["text_config"] |= TINY_K2 | {"pad_token_id": 255}
    k26 |= {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 255}
    (root / "target.json").write_text(json.dumps(k26))
    (root / "drafter.json").write_text(
        json.dumps(drafter_config(block_size=8) | {"num_target_layers": 3})
    )
    return root / "target.json", root / "drafter.json"
