"""A multi-process jaxdd job on one machine, for tests:
P processes x D CPU devices on a free local port (gloo).

    python -m jaxdd.testing.multiprocess --coordinator 127.0.0.1:PORT --num-processes 2
        --process-id I \\
        --devices 8 --run tp:hf=DIR --run ep:jaxdd=DIR

Each process joins the job and, per run, loads the target and drafter in DIR straight onto all the
job's devices in that mode (reading only its own devices' parts) and generates with AR, DFlash and
DDTree; process 0 prints one JSON object ``{"mode:name": {method: tokens}}`` as the one stdout line
starting with ``{`` (gloo prints its own). ``start_job`` runs it and always stops its processes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax

import jaxdd
from jaxdd.runtime.distributed import disagreeing_processes, join

PROMPT = [1, 2, 3, 4, 5, 6, 7]
METHODS = ("ar", "dflash", "ddtree")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_environment() -> dict[str, str]:
    """This environment for a job's processes, less the
    flag that simulates devices (the job sets its own)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    return os.environ | {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags)}


def start_job(
    runs: dict[str, Path], processes: int = 2, devices: int = 8, timeout: float = 300
) -> dict:
    """Run the job and return process 0's result; a process
    that fails or outlives ``timeout`` stops them all."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "jaxdd.testing.multiprocess",
        "--coordinator",
        f"127.0.0.1:{port}",
    ]
    command += ["--num-processes", str(processes), "--devices", str(devices)]
    command += [arg for name, path in runs.items() for arg in ("--run", f"{name}={path}")]
    outputs = run_processes([[*command, "--process-id", str(i)] for i in range(processes)], timeout)
    printed = [line for line in outputs[0].splitlines() if line.startswith("{")]  # gloo prints too
    return json.loads(printed[-1])


def run_processes(commands: list[list[str]], timeout: float) -> list[str]:
    """Start one process per command in ``job_environment()`` and return their stdouts; one
    that fails or outlives ``timeout`` raises, and all are stopped whatever happens."""
    env = job_environment()
    procs = [
        subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for c in commands
    ]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for i, (p, (_, err)) in enumerate(zip(procs, outputs, strict=True)):
        if p.returncode != 0:
            raise RuntimeError(f"process {i} exited {p.returncode}: {err.decode()[-2000:]}")
    return [out.decode() for out, _ in outputs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument(
        "--run", action="append", required=True, help="MODE:NAME=DIR, DIR holding target/, drafter/"
    )
    args = parser.parse_args()
    join(args.coordinator, args.num_processes, args.process_id, args.devices // args.num_processes)
    result: dict = {}
    for run in args.run:
        name, directory = run.split("=", 1)
        mode = name.split(":")[0]
        target, drafter = jaxdd.load_pair(
            Path(directory) / "target", Path(directory) / "drafter", "float32", args.devices, mode
        )
        for method in METHODS:
            out = target.generate(
                PROMPT, drafter=drafter, method=method, max_new_tokens=12, stop_token_ids=[]
            )
            if disagreeing_processes(out.tokens, 12):
                raise SystemExit(f"{name} {method}: the processes disagree")
            result.setdefault(name, {})[method] = out.tokens
    if jax.process_index() == 0:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
