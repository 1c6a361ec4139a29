"""What differs per backend, decided once from the devices a model is placed on: the
verify attention form, the MoE dispatch and the Pallas kernel's compiler parameters.

Model code never asks JAX which backend it runs on; it receives a ``Backend``. That
is what lets a CPU host compile exactly what a GPU or TPU would run (``jaxdd.plan``):
the policy follows the target devices, not the host's default backend.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any, Literal

import jax
from flax import nnx
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from jaxdd.runtime import cpu_kernels
from jaxdd.runtime.cpu_memory import keep_allocations
from jaxdd.runtime.host import PLATFORMS, available_memory
from jaxdd.types import ATTENTIONS, Attention, Dispatch, Platform
from pallas_kernels import int4_experts, int4_experts_tpu
from pallas_kernels.gpu_launch import Gpu
from pallas_kernels.tree_attention import tree_attention
from pallas_kernels.tree_attention_tpu import tree_attention_tpu
from pallas_kernels.tuned_block_sizes import block_sizes

# Shared memory one thread block may opt into, by compute capability (CUDA C++ Programming Guide,
# "Technical Specifications per Compute Capability"): the Pallas kernel's tiles must fit it.
SHARED_MEMORY_PER_BLOCK = {
    "8.0": 163,
    "8.6": 99,
    "8.7": 163,
    "8.9": 99,
    "9.0": 227,
    "10.0": 227,
    "12.0": 99,
}


FP8_COMPUTE_CAPABILITY = (8, 9)  # Ada; Triton has no fp8e4nv before it


@dataclasses.dataclass(frozen=True)
class Backend:
    """The per-platform choices; frozen and hashable,
    so it is a static argument of the jitted rounds."""

    platform: Platform
    # GPUs: bytes of shared memory per block (None: unknown, H200's assumed)
    shared_memory: int | None = None
    # CPU: the kernel form to interpret (tpu: TPU semantics)
    interpreted_kernel: Literal["gpu", "tpu"] = "gpu"
    # CPU: decode's matvecs and paged attention through jaxdd.runtime.cpu_kernels where it builds
    # (False: XLA's)
    cpu_kernels: bool = True
    devices: int = 1  # how many devices the weights are placed on
    # GPUs: whether Triton loads 8-bit floats (fp8e4nv: compute capability 8.9 and newer)
    fp8_kernels: bool = True
    # GPUs: streaming multiprocessors (the kernel's split-KV fills them; None: unknown, H200's)
    multiprocessors: int | None = None

    # MoE on CPU: tiles from this many tokens, ``skipping``
    # below (where kimi-mini's two dispatches break even).
    TILED_MIN_TOKENS = 24
    DENSE_MAX_FLOPS = 2**28  # elsewhere: all-experts compute below this many multiply-adds
    # CPU: pairs per expert up to which the INT4 kernel's gathered dispatch is the fastest
    KERNEL_GATHERED_PAIRS = 4
    DENSE_KERNEL_ROWS = 2  # tokens up to which the dense matvec kernel beats XLA:CPU's matmul

    @classmethod
    def of_devices(cls, devices: Iterable[Any]) -> Backend:
        """The policy for these devices (real ones, or a deviceless topology's)."""
        platforms = {PLATFORMS.get(d.platform.lower(), d.platform.lower()) for d in devices}
        if len(platforms) != 1 or not platforms <= set(PLATFORMS.values()):
            raise ValueError(
                f"devices: expected one platform of cpu, gpu or tpu, got {sorted(platforms)}"
            )
        platform = platforms.pop()
        capabilities = (
            {getattr(d, "compute_capability", None) for d in devices}
            if platform == "gpu"
            else set()
        )
        shared = [SHARED_MEMORY_PER_BLOCK.get(c) for c in capabilities]
        memory = min(shared) * 1024 if shared and None not in shared else None
        known = [tuple(map(int, c.split("."))) for c in capabilities if c]
        fp8 = all(c >= FP8_COMPUTE_CAPABILITY for c in known)  # unknown: H200's assumed
        cores = {getattr(d, "core_count", None) for d in devices} if platform == "gpu" else set()
        sms = min(cores) if cores and None not in cores else None
        return cls(
            platform, memory, devices=len(set(devices)), fp8_kernels=fp8, multiprocessors=sms
        )

    @classmethod
    def local(cls) -> Backend:
        """The policy for this process's devices (training, and modules not placed anywhere)."""
        return cls.of_devices(jax.devices())

    @classmethod
    def of_module(cls, module: nnx.Module) -> Backend:
        """The policy for the devices ``module``'s parameters live on (abstract ones through
        their shardings); JAX's default devices for a module with no placed parameters."""
        for leaf in jax.tree.leaves(nnx.state(module, nnx.Param)):
            sharding = getattr(leaf, "sharding", None)
            if sharding is not None:
                return cls.of_devices(sharding.device_set)
        return cls.local()

    def prepare_host(self) -> None:
        """Once per process before running on this backend: on CPU, keep XLA's
        freed temporaries in the heap (``jaxdd.runtime.cpu_memory``)."""
        if self.platform == "cpu":
            keep_allocations()

    def attention(self, requested: Literal["auto"] | Attention) -> Attention:
        """``auto``: the Pallas tree-attention kernel on GPUs, where it is faster in bf16
        (benchmarks/README.md, "On a GPU"), and on TPUs, where XLA's absorbed attention would hold
        every head's scores over the whole cache (64 heads x 257 tokens x 128k slots: 8.6 GB); the
        absorbed form on CPU (over pools of pages on one device in the C++ kernel,
        ``attention_kernel``)."""
        if requested != "auto" and requested not in ATTENTIONS:
            raise ValueError(
                f"attention: expected 'auto', 'naive', 'absorbed' or 'pallas', got {requested!r}"
            )
        if requested != "auto":
            return requested
        return "absorbed" if self.platform == "cpu" else "pallas"

    def moe_dispatch(
        self,
        tokens: int,
        top_k: int,
        experts: int,
        hidden: int,
        ffn: int,
        quantized: bool,
        kernel: bool = False,
    ) -> Dispatch:
        """The exact dispatch that is fastest for this many tokens (see
        ``jaxdd.models.moe.MoE``). Quantized experts with few (token, slot) pairs (a
        decode step, a short verify) are gathered: decode is bound by the bytes it reads,
        and only the chosen experts are read. Past half as many pairs as experts, every
        expert dequantized once (``scan``) costs less than one dequantization per pair.
        ``kernel``: the experts go through the INT4 matvec kernel (``int4_matvec``), which
        dequantizes as it reads, so gathering pays up to ``KERNEL_GATHERED_PAIRS`` pairs
        per expert on CPU (compute-bound there); elsewhere up to one (on GPU it reads an
        expert per pair, on TPU it dequantizes one per pair; ``scan`` every expert once).
        The thresholds' measurements: benchmarks/README.md, "MoE dispatch thresholds"."""
        pairs = tokens * top_k
        per_expert = self.KERNEL_GATHERED_PAIRS if self.platform == "cpu" else 1
        if quantized and (2 * pairs <= experts or (kernel and pairs <= per_expert * experts)):
            return "gathered"
        if self.platform == "cpu" and not quantized:
            # XLA:CPU runs ragged_dot as a dense matmul over
            # all experts for every pair: skip unused experts.
            return "tiled" if tokens >= self.TILED_MIN_TOKENS else "skipping"
        if 3 * tokens * experts * hidden * ffn <= self.DENSE_MAX_FLOPS:
            return "dense"
        return "scan" if quantized else "grouped"

    def cut_off_ways(self) -> int:
        """Thresholds + 1 that the sampling cut-off search tests per read of the
        values (``jaxdd.decoding.sampling.filtered_probs``): 16 on GPUs, which fuse
        the comparisons into that read; 2 (a bisection) on CPU, whose compiler writes
        them out, and on TPU, whose compiler does at the whole vocabulary (the same
        at TP8's share) (benchmarks/README.md, "What the compiled rounds move")."""
        return 16 if self.platform == "gpu" else 2

    def int4_matvec(self, group: int, unplaced: bool = False) -> Callable[..., jax.Array] | None:
        """The gathered INT4 expert matvec kernel for scale groups of ``group`` inputs: on CPU
        the C++ one (``jaxdd.runtime.cpu_kernels``) where it builds; on GPU the Pallas Triton
        one (``pallas_kernels.int4_experts``: XLA:GPU writes the gathered experts out and
        reads them again); on TPU the Mosaic one (``pallas_kernels.int4_experts_tpu``: XLA:TPU
        relays the gathered experts out in fp32), unless the call is ``unplaced``: on several
        devices outside ``shard_map``, where JAX refuses to partition a Mosaic call (XLA:GPU
        runs a Triton call there on every device); else None (XLA's dequantize-then-dot)."""
        if self.platform == "cpu" and self.cpu_kernels and group % cpu_kernels.GROUP_MULTIPLE == 0:
            return cpu_kernels.gathered_int4_matvec if cpu_kernels.available() else None
        if self.platform == "gpu" and int4_experts.supports(group):
            params = pltriton.CompilerParams(num_warps=block_sizes("triton")["num_warps"])
            return functools.partial(int4_experts.gathered_int4_matvec_gpu, compiler_params=params)
        if self.platform == "tpu" and not unplaced and group % int4_experts_tpu.PER_WORD == 0:
            return int4_experts_tpu.gathered_int4_matvec_tpu
        return None

    def decode_kernels(self, tokens: int) -> ModuleType | None:
        """``jaxdd.runtime.cpu_kernels`` where a forward of ``tokens`` tokens runs
        its dense matvecs and decode attention's products through it: on one CPU
        device (XLA cannot partition a custom call over sharded weights), for up to
        ``DENSE_KERNEL_ROWS`` tokens, where it builds; else None (XLA's matmuls)."""
        if (
            self.platform == "cpu"
            and self.devices == 1
            and tokens <= self.DENSE_KERNEL_ROWS
            and self.cpu_kernels
        ):
            return cpu_kernels if cpu_kernels.available() else None
        return None

    def dense_matvec(self, rows: int) -> Callable[[jax.Array, jax.Array], jax.Array] | None:
        """The dense matvec kernel for ``rows`` rows times a
        weight where ``decode_kernels(rows)``; else None."""
        kernels = self.decode_kernels(rows)
        return kernels.dense_matvec if kernels else None

    @staticmethod
    def free_bytes(devices: Iterable[Any], host: bool = True) -> int | None:
        """What one of ``devices`` can still allocate: its allocator's limit less what
        is in use (GPU, TPU), or with ``host`` this host's available memory shared among its
        devices (CPU: XLA:CPU allocates from host memory); None where neither is known."""
        devices = list(devices)
        stats = devices[0].memory_stats() if hasattr(devices[0], "memory_stats") else None
        if stats and "bytes_limit" in stats:
            return min(
                d.memory_stats()["bytes_limit"] - d.memory_stats().get("bytes_in_use", 0)
                for d in devices
            )
        available = available_memory() if host else None
        return None if available is None else available // len(devices)

    def kernel_options(self) -> dict[str, Any]:
        """Keyword arguments for the kernel's GPU form (``pallas_kernels.tree_attention``):
        interpreted on CPU; on GPU through Triton, not Mosaic GPU (Mosaic stages every block
        in shared memory, and a whole cache block is far over the 227 KB limit; Triton reads
        the cache through pointers), with tiles that fit the GPU's shared memory."""
        if self.platform == "cpu":  # one program at a time: no key splits
            return {"interpret": True, "compiler_params": None, "gpu": Gpu(multiprocessors=1)}
        if self.platform == "gpu":
            params = pltriton.CompilerParams(num_warps=block_sizes("triton")["num_warps"])
            gpu = Gpu(self.shared_memory, self.multiprocessors)
            return {"interpret": False, "compiler_params": params, "gpu": gpu}
        raise ValueError("the TPU form of the kernel takes no GPU options (Backend.tree_attention)")

    def attention_kernel(
        self, attention: Attention, paged: bool
    ) -> Callable[..., jax.Array] | None:
        """The kernel a round's attention runs in (the target's and the drafter's; the arguments of
        ``pallas_kernels.tree_attention.tree_attention_reference``): the tree-attention kernel for
        the ``pallas`` form (``tree_attention``); for the ``absorbed`` form over pools of pages
        (``paged``) on one CPU device, the C++ one where it builds (``cpu_kernels``: each row's
        committed pages read in place, where XLA:CPU gathers every page of each row's table into
        a copy per layer); else None (XLA's einsums)."""
        if attention == "pallas":
            return self.tree_attention()
        if (
            attention == "absorbed"
            and paged
            and self.platform == "cpu"
            and self.devices == 1
            and self.cpu_kernels
            and cpu_kernels.available()
        ):
            return cpu_kernels.tree_attention
        return None

    def tree_attention(self) -> Callable[..., jax.Array]:
        """The tree-attention kernel for this platform, its options bound: the TPU (Mosaic)
        form on TPU, which streams the cache through VMEM; the GPU form elsewhere (Triton
        on GPU, interpreted on CPU). On CPU ``interpreted_kernel="tpu"`` runs the TPU form
        in Pallas' TPU interpreter instead (checking it in the rounds without a TPU)."""
        if self.platform == "tpu":
            return tree_attention_tpu
        if self.platform == "cpu" and self.interpreted_kernel == "tpu":
            return functools.partial(tree_attention_tpu, interpret=pltpu.InterpretParams())
        return functools.partial(tree_attention, **self.kernel_options())
