"""The devices jaxdd plans for, as their vendors describe them: what the traffic
account needs (memory, bandwidth, link), the roofline's peak dense throughput per dtype (with
its source beside it) and, for GPUs, the description a deviceless
compile needs (XLA's GpuTargetConfigProto: compute capability, SMs, shared memory).
TPUs are named by JAX's topology names (``v5p:2x2x2``); their chips are described here.

Sources, per field: memory, bandwidth, link and SMs from NVIDIA's product datasheets /
Google Cloud's TPU pages (named per entry); shared memory per SM and per block (opt-in)
from the CUDA C++ Programming Guide's table of compute capabilities (228 / 227 KB on 9.0
and 10.0, 100 / 99 KB on 12.0); L2 size and clock from the architecture whitepapers. The
collective latency is an estimate (NCCL's small-message all-reduce over 8 GPUs), taken for
every collective whatever its size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

KB = 1024
GB = 1e9
TFLOPS = 1e12


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One device of a node."""

    name: str
    memory: float  # bytes per device
    bandwidth: float  # memory bytes/s per device
    link: float  # bytes/s each way per device for collectives
    link_name: str
    collective_latency: float  # seconds per collective (all-reduce, all-gather, all-to-all)
    source: str
    # dense FLOP/s per dtype a round multiplies in (``jaxdd.planning.roofline``): bf16 on the
    # matrix units with fp32 sums; GPUs' fp32 on the CUDA cores
    peak_flops: Mapping[str, float]
    peak_source: str


@dataclasses.dataclass(frozen=True)
class Gpu(Hardware):
    compute_capability: tuple[int, int] = (9, 0)
    sms: int = 132
    shared_memory_per_sm: int = 228 * KB
    shared_memory_per_block_optin: int = 227 * KB
    l2_bytes: int = 50 * 1024 * KB
    clock_ghz: float = 1.98
    device_kind: str = ""  # what jax.Device.device_kind says on the real GPU

    def target_config(self) -> str:
        """The GpuTargetConfigProto (text format) XLA compiles against when no GPU is present."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: {48 * KB}
  shared_memory_per_core: {self.shared_memory_per_sm}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  threads_per_core_limit: {2048 if major < 12 else 1536}
  core_count: {self.sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.bandwidth)}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {int(self.memory)}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
device_description_str: "{self.device_kind}"
"""


GPUS: dict[str, Gpu] = {
    "h200": Gpu(
        "8 x H200 (NVLink)",
        141 * GB,
        4.8e12,
        450e9,
        "NVLink 4, 900 GB/s both ways",
        10e-6,
        "NVIDIA H200 datasheet: 141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s; Hopper: 132 SMs, 50 MB L2",
        {"bf16": 989 * TFLOPS, "fp32": 67 * TFLOPS},
        "NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): BF16 Tensor Core 1,979 "
        "TFLOPS with sparsity, 989 dense; FP32 67 TFLOPS",
        compute_capability=(9, 0),
        sms=132,
        device_kind="NVIDIA H200",
    ),
    "rtx-pro-6000": Gpu(
        "8 x RTX PRO 6000 (PCIe)",
        96 * GB,
        1.792e12,
        64e9,
        "PCIe 5.0 x16, 64 GB/s each way",
        30e-6,
        "NVIDIA RTX PRO 6000 Blackwell datasheet: 96 GB GDDR7, 1792 GB/s, 188 SMs, PCIe "
        "5.0 x16 (no NVLink); "
        "GB202: 128 MB L2",
        {"bf16": 503.8 * TFLOPS, "fp32": 125.95 * TFLOPS},
        "NVIDIA's RTX PRO 6000 Blackwell figures (as listed at hmc-tech.com/gpu): FP16/BF16 "
        "Tensor with FP32 accumulate 503.8 TFLOPS dense (188 SMs x 1024 FLOP/clock x 2.617 GHz), "
        "FP32 125.95 TFLOPS (24,064 cores)",
        compute_capability=(12, 0),
        sms=188,
        shared_memory_per_sm=100 * KB,
        shared_memory_per_block_optin=99 * KB,
        l2_bytes=128 * 1024 * KB,
        clock_ghz=2.617,
        device_kind="NVIDIA RTX PRO 6000 Blackwell Server Edition",
    ),
    "b200": Gpu(
        "8 x B200 (NVLink)",
        180 * GB,
        8.0e12,
        900e9,
        "NVLink 5, 1.8 TB/s both ways",
        10e-6,
        "NVIDIA DGX B200 datasheet: 1440 GB HBM3e for 8 GPUs, 8 TB/s each, NVLink 5 1.8 "
        "TB/s; 148 SMs, 126 MB L2",
        {"bf16": 2250 * TFLOPS, "fp32": 75 * TFLOPS},
        "NVIDIA HGX B200 specifications (nvidia.com/en-us/data-center/hgx): FP16/BF16 Tensor "
        "Core 4.5 PFLOPS per GPU with sparsity, 2.25 dense; FP32 75 TFLOPS",
        compute_capability=(10, 0),
        sms=148,
        l2_bytes=126 * 1024 * KB,
        clock_ghz=1.965,
        device_kind="NVIDIA B200",
    ),
}

# One chip (one JAX device) per generation, keyed by the prefix of JAX's topology names.
TPUS: dict[str, Hardware] = {
    "v5e": Hardware(
        "TPU v5e",
        16 * GB,
        819e9,
        200e9,
        "ICI 1600 Gbps",
        10e-6,
        "Google Cloud TPU v5e: 16 GB HBM2, 819 GB/s",
        {"bf16": 197 * TFLOPS},
        "cloud.google.com/tpu/docs/v5e: peak compute per chip (bf16) 197 TFLOPs",
    ),
    "v5p": Hardware(
        "TPU v5p",
        95 * GB,
        2765e9,
        600e9,
        "ICI 4800 Gbps",
        10e-6,
        "Google Cloud TPU v5p: 95 GB HBM2e, 2765 GB/s",
        {"bf16": 459 * TFLOPS},
        "cloud.google.com/tpu/docs/v5p: peak compute per chip (bf16) 459 TFLOPs",
    ),
    "v6e": Hardware(
        "TPU v6e",
        32 * GB,
        1640e9,
        448e9,
        "ICI 3584 Gbps",
        10e-6,
        "Google Cloud TPU v6e: 32 GB HBM, 1640 GB/s",
        {"bf16": 918 * TFLOPS},
        "cloud.google.com/tpu/docs/v6e: peak compute per chip (bf16) 918 TFLOPs",
    ),
}


def named_hardware(name: str) -> Hardware | None:
    """The device a plan's ``--hardware`` names (a GPU, or a TPU topology's chip); None for
    ``cpu``, whose simulated devices share the host's memory and have no link to model."""
    return GPUS.get(name) or TPUS.get(name.split(":")[0])
