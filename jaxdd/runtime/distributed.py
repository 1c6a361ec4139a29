"""One process per host: joining a multi-process JAX job
and checking that every process got the same tokens.

Every process runs the same program on the global mesh (``jax.devices()`` spans all
hosts); each holds only its devices' shards. On CPU the collectives go through gloo. Where
JAX finds the job by itself (cloud TPU slices, SLURM, or ``JAX_COORDINATOR_ADDRESS`` /
``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``) no flags are needed.
"""

from __future__ import annotations

import os
import sys
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxdd.errors import InputError

# What JAX's cluster detection reads (jax._src.clusters): a job it can join without being told.
_JOB_ENVIRONMENT = (
    "JAX_COORDINATOR_ADDRESS",
    "SLURM_JOB_ID",
    "TPU_WORKER_HOSTNAMES",
    "MEGASCALE_COORDINATOR_ADDRESS",
)


def join(
    coordinator: str | None,
    num_processes: int | None,
    process_id: int | None,
    cpu_devices: int,
    timeout: float = 60.0,
) -> None:
    """Join the job before any JAX backend starts: with all three flags, or as JAX finds it in the
    environment (a TPU slice of more than one host, SLURM); a single process otherwise.
    ``cpu_devices``: this process's simulated CPU devices (each host's share of ``--devices``). Says
    on stderr what it waits for; when the job is not complete within ``timeout`` seconds, says so in
    one line and exits with code 2 (JAX's own timeout aborts the process with a C++ stack trace)."""
    flags = (coordinator, num_processes, process_id)
    if any(f is not None for f in flags) and not all(f is not None for f in flags):
        raise InputError("--coordinator, --num-processes and --process-id go together")
    if coordinator is None and not _job_in_environment():
        return
    if num_processes is not None and not 0 <= process_id < num_processes:
        raise InputError(f"--process-id: expected 0..{num_processes - 1}, got {process_id}")
    # used only where the devices are CPUs
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", cpu_devices)
    where = (
        f"{num_processes} processes at {coordinator}"
        if coordinator
        else "the job JAX found in the environment"
    )
    print(
        f"jaxdd: waiting for {where} (at most {timeout:g} s: --coordinator-timeout)",
        file=sys.stderr,
        flush=True,
    )
    watchdog = threading.Timer(timeout, _give_up, (where, timeout))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator, num_processes, process_id, initialization_timeout=int(timeout) + 60
        )
    finally:
        watchdog.cancel()


def _give_up(where: str, timeout: float) -> None:
    # os._exit: the main thread is blocked in the coordination
    # service's C++ client, which nothing interrupts.
    print(
        f"jaxdd: {where}: the job did not assemble within {timeout:g} s",
        file=sys.stderr,
        flush=True,
    )
    os._exit(2)


def _job_in_environment() -> bool:
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    named = [v for v in _JOB_ENVIRONMENT if v != "TPU_WORKER_HOSTNAMES" and os.environ.get(v)]
    return bool(named) or "," in hosts


def disagreeing_processes(tokens: list[int], length: int) -> list[int]:
    """The processes whose tokens (at most ``length``) differ from process
    0's: none, unless a host computed something else (its weights, its
    inputs), since all run one SPMD program. Every process must call it."""
    if jax.process_count() == 1:
        return []
    row = np.full((length + 1,), -1, np.int32)
    row[0] = len(tokens)
    row[1 : len(tokens) + 1] = tokens
    every = np.asarray(multihost_utils.process_allgather(row))
    return [p for p in range(every.shape[0]) if not np.array_equal(every[p], every[0])]
