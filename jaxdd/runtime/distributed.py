"""One process per host: joining a multi-process JAX job and checking that every process got the same tokens.

Every process runs the same program on the global mesh (``jax.devices()`` spans all hosts); each holds only its
devices' shards. On CPU the collectives go through gloo. Where JAX finds the job by itself (cloud TPU slices,
SLURM, or ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``) no flags are needed.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxdd.errors import InputError

# What JAX's cluster detection reads (jax._src.clusters): a job it can join without being told.
_JOB_ENVIRONMENT = ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS")


def join(coordinator: str | None, num_processes: int | None, process_id: int | None, cpu_devices: int) -> None:
    """Join the job before any JAX backend starts: with all three flags, or as JAX finds it in the environment
    (a TPU slice of more than one host, SLURM); a single process otherwise. ``cpu_devices``: this process's
    simulated CPU devices (each host's share of ``--devices``)."""
    flags = (coordinator, num_processes, process_id)
    if any(f is not None for f in flags) and not all(f is not None for f in flags):
        raise InputError("--coordinator, --num-processes and --process-id go together")
    if coordinator is None and not _job_in_environment():
        return
    if num_processes is not None and not 0 <= process_id < num_processes:
        raise InputError(f"--process-id: expected 0..{num_processes - 1}, got {process_id}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # used only where the devices are CPUs
    jax.config.update("jax_num_cpu_devices", cpu_devices)
    jax.distributed.initialize(coordinator, num_processes, process_id)


def _job_in_environment() -> bool:
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    named = [v for v in _JOB_ENVIRONMENT if v != "TPU_WORKER_HOSTNAMES" and os.environ.get(v)]
    return bool(named) or "," in hosts


def disagreeing_processes(tokens: list[int], length: int) -> list[int]:
    """The processes whose tokens (at most ``length``) differ from process 0's: none, unless a host computed
    something else (its weights, its inputs), since all run one SPMD program. Every process must call it."""
    if jax.process_count() == 1:
        return []
    row = np.full((length + 1,), -1, np.int32)
    row[0], row[1 : len(tokens) + 1] = len(tokens), tokens
    every = np.asarray(multihost_utils.process_allgather(row))
    return [p for p in range(every.shape[0]) if not np.array_equal(every[p], every[0])]
