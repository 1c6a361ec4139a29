"""What simulated CPU devices cost the host: peak memory of ``python -m jaxdd.generate --devices
N`` on the bundled pair (2 greedy DFlash tokens), the basis of
``jaxdd.runtime.backend_start.CPU_DEVICE_PAIR_BYTES``.

    python benchmarks/simulated_devices.py
        [--devices 8 64 128 256]  # -> benchmarks/results/simulated_devices.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULT = Path(__file__).parent / "results" / "simulated_devices.json"


def peak(devices: int) -> dict:
    """One run in a fresh process (the largest child's
    peak RSS is what getrusage reports after it)."""
    argv = [
        sys.executable,
        "-m",
        "jaxdd.generate",
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "2",
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAXDD_COMPILATION_CACHE="off")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    start = time.perf_counter()
    subprocess.run(
        [*argv, "--devices", str(devices)], env=env, check=True, capture_output=True, timeout=600
    )
    seconds = time.perf_counter() - start
    return {
        "devices": devices,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
        "seconds": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--devices", type=int, nargs="+", default=[8, 64, 128, 256], help="counts, ascending"
    )
    args = parser.parse_args()
    # ascending: each child's peak is above the ones before
    runs = [peak(n) for n in sorted(args.devices)]
    pairs = [
        (b["peak_rss_bytes"] - a["peak_rss_bytes"]) / (b["devices"] ** 2 - a["devices"] ** 2)
        for a, b in itertools.pairwise(runs)
    ]
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    result = {"machine": machine, "runs": runs, "bytes_per_device_pair": [round(p) for p in pairs]}
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
