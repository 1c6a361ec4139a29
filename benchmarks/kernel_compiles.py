"""The tree-attention kernel compiled deviceless at Kimi's latent sizes (512 + 64, bf16) for
TPU v5e / v5p / v6e (its Mosaic form) and H200 / RTX PRO 6000 (its Triton form), one run.

    python benchmarks/kernel_compiles.py [--targets v5e:2x2,v5p:2x2x2,...]

Heads per device 8 and 64 (Kimi's 64 over TP8, or whole), trees of 17, 65 and 257
tokens, caches of 4k, 32k and 128k slots. Per compile: seconds; on TPU the scoped
VMEM the kernel needs (the least limit, ``vmem_limit_bytes``, Mosaic compiles it
under); on GPU the shared memory per block Triton asks for (what the compile names
when the GPU is described with less), the launch grid's programs and the key splits among
them (split-KV). Writes benchmarks/results/kernel_compiles.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import re
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# first: JAX without the CUDA plugin's start-up lines
import jaxdd.runtime.startup  # noqa: F401, I001
import jax
import jax.numpy as jnp

from jax.experimental import topologies

from jaxdd.planning.aot import GPU_COMPILER_OPTIONS, find_machine
from jaxdd.runtime.backend import Backend
from jaxdd.planning.hardware import GPUS
from jaxdd.testing.benchmark import write_result
from pallas_kernels.gpu_launch import launch
from pallas_kernels.tree_attention_tpu import tpu_tiles, tree_attention_tpu
from pallas_kernels.tree_operands import TreeOperands

RESULTS = Path(__file__).parent / "results" / "kernel_compiles.json"
TARGETS = ["v5e:2x2", "v5p:2x2x2", "v6e:2x2", "h200", "rtx-pro-6000"]
HEADS, TREES, SLOTS = (8, 64), (17, 65, 257), (4096, 32768, 131072)
GRANULE = 64 * 2**10
PROBE_SHARED_MEMORY = 1024  # bytes per block: under any kernel's need


def kernel_args(device, tokens: int, heads: int, slots: int) -> TreeOperands:
    spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=device)
    t, h = tokens, heads
    shapes = [(1, t, h, 512), (1, t, h, 64), (1, slots, 512), (1, slots, 64)]
    args = [spec(s) for s in shapes] + [spec((1,), jnp.int32), spec((1, t, 512)), spec((1, t, 64))]
    return TreeOperands(*args, spec((1, t, t), jnp.bool_))


def compiles_within(args, limit: int) -> bool:
    kernel = jax.jit(functools.partial(tree_attention_tpu, scale=0.1, vmem_limit_bytes=limit))
    try:
        kernel.lower(args).compile()
    except jax.errors.JaxRuntimeError as error:
        if "CompileTimeScopedVmemOom" not in str(error):
            raise
        return False
    return True


@functools.cache
def vmem_needed(target: str, tokens: int, heads: int) -> int:
    """The least scoped-VMEM limit Mosaic compiles the kernel under (to 64 KiB), found by bisection;
    the tiles do not depend on the cache's size, so neither does this (measured at 4k slots)."""
    where = find_machine(target, 1)
    args = kernel_args(
        jax.sharding.SingleDeviceSharding(where.devices[0]), tokens, heads, min(SLOTS)
    )
    low, high = 0, 32 * 2**20  # compiles at high (every chip's VMEM is larger)
    while high - low > GRANULE:
        middle = (low + high) // 2 // GRANULE * GRANULE
        low, high = (low, middle) if compiles_within(args, middle) else (middle, high)
    return high


@functools.cache
def probe_gpu(name: str) -> tuple:
    """``name``'s GPU described with 1 KB of shared memory per block:
    every kernel's compile is refused there, naming the shared memory
    it requests (the kernel keeps the tiles the real GPU gets)."""
    gpu = dataclasses.replace(GPUS[name], shared_memory_per_block_optin=PROBE_SHARED_MEMORY)
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=gpu.target_config(), topology="1x1x1"
    )
    return tuple(topology.devices)


def shared_memory_requested(name: str, tokens: int, heads: int, slots: int) -> int:
    devices = probe_gpu(name)
    args = kernel_args(jax.sharding.SingleDeviceSharding(devices[0]), tokens, heads, slots)
    kernel = jax.jit(functools.partial(Backend.of_devices(devices).tree_attention(), scale=0.1))
    try:
        kernel.lower(args).compile(compiler_options=GPU_COMPILER_OPTIONS)
    except jax.errors.JaxRuntimeError as error:
        requested = re.search(r"Shared memory size limit exceeded: requested (\d+)", str(error))
        if requested:
            return int(requested.group(1))
        raise
    return PROBE_SHARED_MEMORY


def row(target: str, tokens: int, heads: int, slots: int) -> dict:
    where = find_machine(target, 1)
    args = kernel_args(jax.sharding.SingleDeviceSharding(where.devices[0]), tokens, heads, slots)
    kernel = jax.jit(functools.partial(where.backend.tree_attention(), scale=0.1))
    start = time.perf_counter()
    kernel.lower(args).compile(compiler_options=where.compiler_options)
    result = {"target": target, "tokens": tokens, "heads": heads, "slots": slots}
    result["compile_s"] = round(time.perf_counter() - start, 2)
    if where.platform == "tpu":
        result["vmem_bytes"] = vmem_needed(target, tokens, heads)
        result["tiles"] = tpu_tiles(tokens, heads, slots)._asdict()
    else:
        result["shared_memory_bytes"] = shared_memory_requested(target, tokens, heads, slots)
        gpu = where.backend.kernel_options()["gpu"]
        chosen = launch(1, tokens * heads, slots, None, jnp.bfloat16, gpu=gpu)
        result["multiprocessors"] = gpu.multiprocessors
        result["splits"] = chosen.splits
        result["programs"] = math.prod(chosen.grid(1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = []
    for target in args.targets.split(","):
        for heads in HEADS:
            for tokens in TREES:
                for slots in SLOTS:
                    rows.append(row(target, tokens, heads, slots))
                    r = rows[-1]
                    vmem = f"{r['vmem_bytes'] / 2**20:5.2f} MiB VMEM" if "vmem_bytes" in r else ""
                    vmem = vmem or (
                        f"{r['shared_memory_bytes'] / 2**10:5.1f} KiB shared memory, "
                        f"{r['programs']} programs ({r['splits']} splits) on "
                        f"{r['multiprocessors']} SMs"
                    )
                    shape = f"{heads:>2} heads {tokens:>3} tokens {slots:>6} slots"
                    print(f"{target:>13} {shape}: {r['compile_s']:5.2f} s {vmem}")
    write_result(
        args.out,
        {"dtype": "bfloat16", "latent": 512, "rope": 64, "rows": rows},
        jax=jax.__version__,
    )


if __name__ == "__main__":
    main()
