"""Compiling for devices this host does not have (deviceless AOT): a GPU from
its description, a TPU slice by JAX's topology name, or this host's CPU devices.

JAX builds compile-only devices from the CUDA PJRT plugin (``jax-cuda12-plugin``, given
XLA's GpuTargetConfigProto from ``jaxdd.planning.hardware``) or from libtpu (given a
topology name such as ``v5p:2x2x2``); a program lowered with shardings over them compiles
with that backend's own compiler, so its memory analysis is the target's, not XLA:CPU's
(which keeps fp32 copies no GPU makes). ``pip install 'jaxdd[aot]'`` installs both.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

import jax
from jax.experimental import topologies

from jaxdd.errors import InputError
from jaxdd.planning.hardware import GPUS, TPUS
from jaxdd.runtime.backend import Backend
from jaxdd.types import Platform

# libtpu asks the cloud metadata server which slice it is on unless told it is on none, and takes
# a lock file that lets one process at a time use it (compiling needs no chip: several may).
TPU_ENVIRONMENT = {
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}
# A deviceless compile cannot time kernels: XLA:GPU's autotuner would pick among Triton GEMM tilings
# by running them. With Triton GEMMs off, matmuls go to cuBLAS (what XLA falls back to anyway).
GPU_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}
INSTALL_HINT = "pip install 'jaxdd[aot]'"


@dataclasses.dataclass(frozen=True)
class Machine:
    """The devices one plan compiles for and what each can hold."""

    name: str  # as asked: "cpu", "rtx-pro-6000", "v5p:2x2x2"
    platform: Platform
    devices: tuple[Any, ...]  # jax.Device: real (cpu) or compile-only
    memory: float  # bytes per device
    description: str
    compiler_options: dict[str, Any]

    @property
    def backend(self) -> Backend:
        return Backend.of_devices(self.devices)

    @property
    def processes(self) -> int:
        """Hosts the program spans (a TPU slice past one host's chips is one process per host)."""
        return len({d.process_index for d in self.devices})


def names() -> list[str]:
    return ["cpu", *GPUS, *(f"{chip}:<topology>" for chip in TPUS)]


def find_machine(name: str, devices: int | None = None) -> Machine:
    """The target ``name`` with its first ``devices`` devices (default: 8
    GPUs, the TPU topology's chips, all of this process's CPU devices)."""
    if name == "cpu":
        return _fit(
            name, "cpu", jax.devices("cpu"), devices, _host_memory_per_device, "this host's CPU", {}
        )
    if name in GPUS:
        gpu = GPUS[name]
        count = 8 if devices is None else devices
        if count < 1:
            raise InputError(f"--devices: expected at least 1, got {count}")
        try:
            topology = topologies.get_topology_desc(
                platform="cuda", target_config=gpu.target_config(), topology=f"1x1x{count}"
            )
        except (NotImplementedError, RuntimeError) as error:
            hint = _hint("jax_plugins.xla_cuda12")
            raise InputError(f"--hardware {name}: {_first_line(error)}{hint}") from None
        return _fit(
            name,
            "gpu",
            topology.devices,
            count,
            lambda _: gpu.memory,
            gpu.source,
            GPU_COMPILER_OPTIONS,
        )
    chip = TPUS.get(name.split(":")[0])
    if chip is None or ":" not in name:
        raise InputError(f"--hardware: expected one of {', '.join(names())}, got {name!r}")
    for key, value in TPU_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    try:
        topology = topologies.get_topology_desc(topology_name=name, platform="tpu")
    except RuntimeError as error:  # no libtpu, or a topology it does not know
        raise InputError(f"--hardware {name}: {_first_line(error)}{_hint('libtpu')}") from None
    return _fit(name, "tpu", topology.devices, devices, lambda _: chip.memory, chip.source, {})


def _fit(name, platform, available, count, memory, description, options) -> Machine:
    available = list(available)
    count = len(available) if count is None else count
    if not 1 <= count <= len(available):
        raise InputError(f"--devices: {name} has {len(available)} devices, asked for {count}")
    chosen = tuple(available[:count])
    return Machine(name, platform, chosen, float(memory(chosen)), description, options)


def _host_memory_per_device(devices) -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / len(devices)


def _hint(module: str) -> str:
    """How to get the compiler, when it is what is missing."""
    return (
        ""
        if importlib.util.find_spec(module) is not None
        else f" ({INSTALL_HINT} installs {module})"
    )


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
