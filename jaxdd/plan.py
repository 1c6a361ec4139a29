"""``python -m jaxdd.plan``: will a full-size target + drafter fit, and how are the bytes spread over the devices?

    python -m jaxdd.plan --config CONFIG.json --drafter-config DRAFTER.json --devices 8 --moe tp|ep \\
        --budget 64 --max-len 8192 --batch 1 [--layers N] [--json]

Builds both models abstractly (shapes and shardings only, nothing allocated), lowers and compiles one DDTree
round ahead of time on a mesh of simulated CPU devices, and reports per-device bytes: weights as stored (INT4 or
FP8 routed experts included), caches (the target's MLA latent rows and the drafter's K/V), and the temporaries
of the compiled executable (its memory analysis), then whether that fits 8 x H200 and 8 x RTX PRO 6000.
``--layers`` keeps the full width but fewer layers (for quick checks). The round is compiled with the XLA
attention form; the Pallas kernel's working set is smaller than XLA's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

GB = 1e9
GPUS = {"8 x H200 (141 GB)": 141 * GB, "8 x RTX PRO 6000 (96 GB)": 96 * GB}


def plan(
    config_path: str | Path,
    drafter_config_path: str | Path,
    devices: int = 8,
    moe: str = "ep",
    budget: int = 64,
    max_len: int = 8192,
    batch: int = 1,
    layers: int | None = None,
) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxdd.config import DrafterConfig, KimiConfig
    from jaxdd.drafter import DFlashDrafter
    from jaxdd.hf_weights import declared_expert_format
    from jaxdd.jit_state import split_module
    from jaxdd.sampling import GREEDY, SamplingArrays
    from jaxdd.sharding import make_mesh, param_shardings, place
    from jaxdd.speculative import MAX_STOP_TOKENS, DecodeState, cache_slots, ddtree_round, state_shardings
    from jaxdd.target import KimiTarget

    raw = json.loads(Path(config_path).read_text())
    config = KimiConfig.from_hf(raw)
    drafter_config = DrafterConfig.from_json_file(drafter_config_path)
    if layers is not None:  # full width, fewer layers; the drafter taps the layers that remain
        config = dataclasses.replace(
            config, num_hidden_layers=layers, first_k_dense_replace=min(config.first_k_dense_replace, layers - 1)
        )
        taps = tuple(min(t, layers - 1) for t in drafter_config.target_layer_ids)
        drafter_config = dataclasses.replace(drafter_config, target_layer_ids=taps)
    experts = declared_expert_format(raw)
    mesh = make_mesh(devices)
    dtype = jnp.bfloat16
    block = drafter_config.block_size

    def abstract(make) -> tuple[nnx.Module, int]:
        """An abstract module placed on the mesh, and the bytes of parameters each device holds."""
        module = nnx.eval_shape(make)
        shardings = param_shardings(module, mesh, moe)
        place(module, mesh, moe)
        state = nnx.state(module, nnx.Param)
        is_variable = lambda x: isinstance(x, nnx.Variable)
        placed = jax.tree.map(
            lambda v, s: jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype, sharding=s),
            state,
            shardings,
            is_leaf=is_variable,
        )
        nnx.update(module, placed)
        per_device = sum(_shard_bytes(x) for x in jax.tree.leaves(placed))
        return module, per_device

    target, target_bytes = abstract(lambda: KimiTarget(config, dtype, experts=experts, rngs=nnx.Rngs(0)))
    drafter, drafter_bytes = abstract(lambda: DFlashDrafter(drafter_config, dtype, rngs=nnx.Rngs(0)))

    slots = cache_slots(max_len + budget + 1)
    rng = jax.ShapeDtypeStruct((batch, 2), jnp.uint32)
    state = jax.eval_shape(lambda rng: DecodeState.empty(config, drafter_config, batch, slots, block, dtype, rng), rng)
    shardings = state_shardings(state, mesh)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
    target_cache_bytes = sum(_shard_bytes(x) for x in jax.tree.leaves(state.target_cache))
    draft_cache_bytes = sum(_shard_bytes(x) for x in jax.tree.leaves(state.draft_cache))

    t_spec, t_weights = split_module(target)
    d_spec, d_weights = split_module(drafter)
    limit = jax.ShapeDtypeStruct((batch,), jnp.int32)
    stop_ids = jax.ShapeDtypeStruct((batch, MAX_STOP_TOKENS), jnp.int32)
    start = time.perf_counter()
    settings = jax.eval_shape(lambda: SamplingArrays.of([GREEDY] * batch))
    inputs = (state, limit, stop_ids, settings)
    lowered = ddtree_round.lower(t_spec, t_weights, d_spec, d_weights, *inputs, block, budget, None, "absorbed")
    compiled = lowered.compile()
    compile_seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    temporaries = int(memory.temp_size_in_bytes)
    per_device = {
        "target_weights": target_bytes,
        "drafter_weights": drafter_bytes,
        "target_cache": target_cache_bytes,
        "drafter_cache": draft_cache_bytes,
        "temporaries": temporaries,
    }
    total = sum(per_device.values())
    return {
        "config": str(config_path),
        "layers": config.num_hidden_layers,
        "routed_experts": experts.kind,
        "devices": devices,
        "moe": moe,
        "budget": budget,
        "max_len": max_len,
        "cache_slots": slots,
        "batch": batch,
        "per_device_bytes": per_device | {"total": total},
        "compiled": {
            "argument_bytes": int(memory.argument_size_in_bytes),
            "output_bytes": int(memory.output_size_in_bytes),
            "alias_bytes": int(memory.alias_size_in_bytes),
            "temp_bytes": temporaries,
            "compile_seconds": round(compile_seconds, 1),
        },
        "fits": {name: bool(total <= capacity) for name, capacity in GPUS.items()},
        "stored_bytes": {  # all devices together
            "target": sum(_bytes(x) for x in jax.tree.leaves(nnx.state(target, nnx.Param))),
            "drafter": sum(_bytes(x) for x in jax.tree.leaves(nnx.state(drafter, nnx.Param))),
        },
    }


def _shard_bytes(x) -> int:
    """Bytes of one device's shard of an abstract array."""
    return _bytes(x, x.sharding.shard_shape(x.shape))


def _bytes(x, shape: tuple[int, ...] | None = None) -> int:
    import numpy as np

    return int(np.prod(x.shape if shape is None else shape, dtype=np.int64)) * x.dtype.itemsize


def report(result: dict[str, Any]) -> str:
    b = result["per_device_bytes"]
    lines = [
        f"{result['config']}: {result['layers']} layers, routed experts {result['routed_experts']}, "
        f"{result['devices']} devices, MoE {result['moe']}, DDTree budget {result['budget']}, "
        f"batch {result['batch']}, max length {result['max_len']} ({result['cache_slots']} cache slots)",
        "per device:",
    ]
    lines += [f"  {name:<16} {value / GB:9.2f} GB" for name, value in b.items()]
    lines += [f"compiled in {result['compiled']['compile_seconds']} s"]
    lines += [f"fits {name}: {'yes' if ok else 'no'}" for name, ok in result["fits"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxdd.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="target HF config.json (kimi_k25 / kimi_k2 / deepseek_v3)")
    parser.add_argument("--drafter-config", required=True, help="DFlash drafter config.json")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--moe", choices=["tp", "ep"], default="ep")
    parser.add_argument("--budget", type=int, default=64, help="DDTree nodes per round")
    parser.add_argument("--max-len", type=int, default=8192, help="prompt + generated tokens")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, help="keep the full width but only this many layers")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    # Simulated devices must exist before JAX starts its CPU backend.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", max(args.devices, 1))
    result = plan(
        args.config, args.drafter_config, args.devices, args.moe, args.budget, args.max_len, args.batch, args.layers
    )
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
