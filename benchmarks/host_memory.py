"""Peak host memory per process when 1, 2 or 4 processes (one per "host", 8/P CPU devices
each) load one HF checkpoint onto the job's 8-device expert-parallel mesh, one run.

    python benchmarks/host_memory.py [--layers 6] [--experts 64] [--width 512]

Two ways: ``placed`` (``jaxdd.load_target(..., mesh=, moe="ep")``: each process reads only
its devices' parts) and ``whole`` (every process reads the whole checkpoint, then
``shard_module`` keeps its shards: what the HF loader did before). CPU devices keep their
arrays in the process's memory, so a process's resident memory is what a host's RAM would
hold while loading (a GPU host holds its shards in device memory instead, and only the
reads in RAM). Peak resident memory (VmHWM) above the memory with JAX started, per process;
the largest over processes is reported. Writes benchmarks/results/host_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxdd.testing.benchmark import write_result
from jaxdd.testing.multiprocess import free_port, run_processes
from jaxdd.testing.synthetic_checkpoint import write_synthetic_target

RESULTS = Path(__file__).parent / "results" / "host_memory.json"
DEVICES = 8


def worker(checkpoint: Path, way: str, processes: int, process_id: int, port: int) -> None:
    """One process of the job: load, then print its memory as one JSON line."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jaxdd
    from jaxdd.runtime.distributed import join
    from jaxdd.runtime.sharding import make_mesh, shard_module
    from jaxdd.testing.benchmark import process_memory_mb

    if processes > 1:
        join(f"127.0.0.1:{port}", processes, process_id, DEVICES // processes)
    else:
        jax.config.update("jax_num_cpu_devices", DEVICES)
    jnp.zeros(1).block_until_ready()  # the backend is up before the baseline
    before = process_memory_mb("VmRSS")
    mesh = make_mesh(DEVICES)
    if way == "placed":
        model = jaxdd.load_target(checkpoint, dtype="float32", mesh=mesh, moe="ep").model
    else:
        model = jaxdd.load_target(checkpoint, dtype="float32").model
        shard_module(model, mesh, "ep")
    leaves = jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
    held = sum(s.data.nbytes for leaf in leaves for s in leaf.addressable_shards)
    peak = process_memory_mb("VmHWM")
    print(
        json.dumps(
            {"process": process_id, "before_mb": before, "peak_mb": peak, "held_mb": held / 2**20}
        )
    )


def measure(checkpoint: Path, way: str, processes: int) -> dict:
    port = free_port()
    base = [sys.executable, __file__, "--worker", str(checkpoint), way, str(processes)]
    outputs = run_processes([[*base, str(i), str(port)] for i in range(processes)], timeout=600)
    rows = [
        json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
        for out in outputs
    ]
    growth = max(r["peak_mb"] - r["before_mb"] for r in rows)
    return {
        "way": way,
        "processes": processes,
        "peak_growth_mb_per_process": round(growth, 1),
        "per_process": rows,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        checkpoint, way, processes, process_id, port = sys.argv[2:]
        return worker(Path(checkpoint), way, int(processes), int(process_id), int(port))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        checkpoint, largest_mb = write_synthetic_target(
            Path(directory) / "target", args.layers, args.experts, args.width
        )
        size_mb = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors")) / 2**20
        rows = [measure(checkpoint, way, p) for way in ("placed", "whole") for p in (1, 2, 4)]
    for row in rows:
        print(
            f"{row['way']:>6}  {row['processes']} processes: peak "
            f"+{row['peak_growth_mb_per_process']:.0f} MB each"
        )
    report = {
        "checkpoint": {
            "size_mb": round(size_mb, 1),
            "largest_layer_mb": round(largest_mb, 1),
            **vars(args),
        },
        "devices": DEVICES,
        "moe": "ep",
        "rows": rows,
    }
    write_result(RESULTS, report)


if __name__ == "__main__":
    main()
