"""Conversion throughput and peak host memory against
checkpoint size (HF bf16 -> jaxdd bf16), CPU, one run.

    python benchmarks/convert_throughput.py [--sizes-gb 0.25 0.5 1 2] [--tmp DIR]

Synthetic Kimi-shaped checkpoints (one shard per layer; layers grow in number,
not in size) are generated in a temporary directory and deleted afterwards, never
committed. Each conversion runs in a fresh process that reports its own peak RSS.
Writes benchmarks/results/convert_throughput.json and convert_throughput.png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from jaxdd.testing.benchmark import write_result
from jaxdd.testing.synthetic_checkpoint import measure_conversion, write_synthetic_target

RESULTS = Path(__file__).parent / "results"
EXPERTS, WIDTH = 64, 512  # ~48 MiB of bf16 experts per layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0])
    parser.add_argument(
        "--tmp", help="where to write the synthetic checkpoints (default: the system temp dir)"
    )
    args = parser.parse_args()
    rows = []
    for size in args.sizes_gb:
        root = Path(tempfile.mkdtemp(dir=args.tmp))
        try:
            layer_mb = 3 * EXPERTS * WIDTH * (WIDTH // 2) * 2 / 2**20
            layers = max(2, round(size * 1024 / layer_mb))
            source, largest_mb = write_synthetic_target(
                root / "hf", layers, EXPERTS, WIDTH, dtype="bfloat16"
            )
            source_mb = sum(f.stat().st_size for f in source.glob("*.safetensors")) / 2**20
            measured = measure_conversion(source, root / "jaxdd", "bfloat16")
        finally:
            shutil.rmtree(root, ignore_errors=True)
        growth = measured["peak_rss_mb"] - measured["rss_before_mb"]
        row = {
            "layers": layers,
            "checkpoint_mb": round(source_mb, 1),
            "largest_shard_mb": round(largest_mb, 1),
            "seconds": round(measured["seconds"], 2),
            "throughput_mb_s": round(source_mb / measured["seconds"], 1),
            "rss_before_mb": round(measured["rss_before_mb"], 1),
            "peak_rss_mb": round(measured["peak_rss_mb"], 1),
            "rss_growth_mb": round(growth, 1),
            "growth_over_largest_shard": round(growth / largest_mb, 2),
        }
        print(json.dumps(row))
        rows.append(row)
    write_result(RESULTS / "convert_throughput.json", {"runs": rows})
    plot(rows)


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["checkpoint_mb"] / 1024 for r in rows]
    fig, (memory, speed) = plt.subplots(1, 2, figsize=(10, 4))
    memory.plot(sizes, [r["rss_growth_mb"] for r in rows], "o-", label="peak RSS growth")
    memory.plot(sizes, [r["largest_shard_mb"] for r in rows], "s--", label="largest layer")
    memory.plot(sizes, [r["checkpoint_mb"] for r in rows], ":", label="checkpoint size")
    memory.set(xlabel="checkpoint (GiB)", ylabel="MiB", title="host memory during conversion")
    memory.legend()
    speed.plot(sizes, [r["throughput_mb_s"] for r in rows], "o-")
    speed.set(
        xlabel="checkpoint (GiB)", ylabel="MB/s", title="conversion throughput", ylim=(0, None)
    )
    fig.tight_layout()
    fig.savefig(RESULTS / "convert_throughput.png", dpi=100)


if __name__ == "__main__":
    main()
