"""NVIDIA aiperf, the load client SGLang and vLLM users already run, against python -m jaxdd.serve
on the bundled pair: the completions and chat endpoints, streamed, synthetic prompts.

    python benchmarks/serve_aiperf.py [--aiperf aiperf] [--concurrency 8] [--requests 32]

aiperf is not a jaxdd dependency (it pins its own stack): install it in a venv of its own
(``python3 -m venv /tmp/aiperf && /tmp/aiperf/bin/pip install aiperf==0.13.0``) and name its
executable with ``--aiperf``. Writes benchmarks/results/serve_aiperf.json: per endpoint the
requests, errors, output tokens/s, TTFT and inter-token latency as aiperf measured them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from jaxdd.cli import DEMO
from jaxdd.testing.benchmark import write_result
from jaxdd.testing.server import running_server

RESULTS = Path(__file__).resolve().parent / "results" / "serve_aiperf.json"
ENDPOINTS = ("completions", "chat")


def profile(aiperf: str, url: str, endpoint: str, args: argparse.Namespace, out: Path) -> dict:
    """One aiperf run on one endpoint; the figures read back from its JSON export."""
    command = [aiperf, "profile", "--model", "kimi-mini", "--url", url]
    command += ["--endpoint-type", endpoint, "--streaming", "--tokenizer", str(DEMO / "target")]
    command += ["--synthetic-input-tokens-mean", str(args.input_tokens)]
    command += ["--output-tokens-mean", str(args.output_tokens)]
    command += ["--concurrency", str(args.concurrency), "--request-count", str(args.requests)]
    command += ["--artifact-dir", str(out)]
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=args.seconds)
    export = json.loads((out / "profile_export_aiperf.json").read_text())
    return {
        "command": " ".join(command[1:]),
        "requests": export["request_count"]["avg"],
        "errors": len(export.get("error_summary") or []),
        "output_tokens_per_s": export["output_token_throughput"]["avg"],
        "ttft_ms_p50": export["time_to_first_token"]["p50"],
        "ttft_ms_p99": export["time_to_first_token"]["p99"],
        "inter_token_ms_p50": export["inter_token_latency"]["p50"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--aiperf", default="aiperf", help="the aiperf executable")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--input-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=48)
    parser.add_argument("--seconds", type=int, default=900, help="bound on each aiperf run")
    args = parser.parse_args()
    server_args = ["--max-batch", str(args.concurrency), "--max-len", "512"]
    with (
        tempfile.TemporaryDirectory() as scratch,
        running_server(server_args, Path(scratch) / "server.log") as server,
    ):
        rows = {
            endpoint: profile(args.aiperf, server.url, endpoint, args, Path(scratch) / endpoint)
            for endpoint in ENDPOINTS
        }
    for endpoint, row in rows.items():
        print(endpoint, {k: v for k, v in row.items() if k != "command"})
    settings = {"server": server_args, **{k: v for k, v in vars(args).items() if k != "aiperf"}}
    write_result(RESULTS, {"settings": settings, "endpoints": rows})


if __name__ == "__main__":
    main()
