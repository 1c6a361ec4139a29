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

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdd.api import Target
from jaxdd.config import DrafterConfig, KimiConfig
from jaxdd.decoder import RequestPlan, SpeculativeDecoder, cache_slots
from jaxdd.drafter import DFlashDrafter
from jaxdd.hf_weights import declared_expert_format
from jaxdd.rounds import DecodeState, Requests, state_shardings
from jaxdd.sampling import GREEDY, SamplingArrays
from jaxdd.sharding import make_mesh, param_shardings, place
from jaxdd.target import KimiTarget
from jaxdd.traffic import ModelBytes, format_table, traffic_table
from jaxdd.validation import MAX_STOP_TOKENS

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
    compile_round: bool = True,
) -> dict[str, Any]:
    """Compile one DDTree round of the full-size pair ahead of time and count its bytes per device, with the
    traffic account of AR / DFlash / DDTree rounds at ``max_len`` tokens of context (``jaxdd.traffic``);
    ``compile_round=False``: the traffic account only (seconds, not minutes)."""
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
    decoder, per_device, stored = _abstract_decoder(config, drafter_config, experts, mesh, moe, jnp.bfloat16)
    slots = cache_slots(max_len + budget + 1)
    model_bytes = ModelBytes.of(decoder.target.model, decoder.drafter, _shard_bytes)
    shape = {
        "config": str(config_path),
        "layers": config.num_hidden_layers,
        "routed_experts": experts.kind,
        "devices": devices,
        "moe": moe,
        "budget": budget,
        "max_len": max_len,
        "cache_slots": slots,
        "batch": batch,
        "traffic": traffic_table(config, model_bytes, devices, moe, max_len, drafter_config.block_size),
    }
    if not compile_round:
        return shape
    request_plan, state = _abstract_requests(decoder, mesh, config, drafter_config, budget, batch, slots)
    per_device["target_cache"] = sum(_shard_bytes(x) for x in jax.tree.leaves(state.target_cache))
    per_device["drafter_cache"] = sum(_shard_bytes(x) for x in jax.tree.leaves(state.draft_cache))

    start = time.perf_counter()
    compiled = decoder.lower_round(request_plan, state).compile()
    compile_seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    per_device["temporaries"] = int(memory.temp_size_in_bytes)
    total = sum(per_device.values())
    return shape | {
        "per_device_bytes": per_device | {"total": total},
        "compiled": {
            "argument_bytes": int(memory.argument_size_in_bytes),
            "output_bytes": int(memory.output_size_in_bytes),
            "alias_bytes": int(memory.alias_size_in_bytes),
            "temp_bytes": per_device["temporaries"],
            "compile_seconds": round(compile_seconds, 1),
        },
        "fits": {name: bool(total <= capacity) for name, capacity in GPUS.items()},
        "stored_bytes": stored,  # all devices together
    }


def _abstract_decoder(config, drafter_config, experts, mesh: jax.sharding.Mesh, moe: str, dtype):
    """A decoder over abstract models placed on a mesh (shapes and shardings only, nothing allocated), the bytes
    of parameters each device holds, and the bytes stored on all devices together."""

    def abstract(make) -> tuple[nnx.Module, int, int]:
        module = nnx.eval_shape(make)
        shardings = param_shardings(module, mesh, moe)
        place(module, mesh, moe)
        is_variable = lambda x: isinstance(x, nnx.Variable)
        placed = jax.tree.map(
            lambda v, s: jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype, sharding=s),
            nnx.state(module, nnx.Param),
            shardings,
            is_leaf=is_variable,
        )
        nnx.update(module, placed)
        leaves = jax.tree.leaves(placed)
        return module, sum(_shard_bytes(x) for x in leaves), sum(_bytes(x) for x in leaves)

    target, target_bytes, target_stored = abstract(lambda: KimiTarget(config, dtype, experts=experts, rngs=nnx.Rngs(0)))
    drafter, drafter_bytes, drafter_stored = abstract(lambda: DFlashDrafter(drafter_config, dtype, rngs=nnx.Rngs(0)))
    # The round jaxdd.generate runs, but with XLA's attention: the kernel's working set is smaller.
    decoder = SpeculativeDecoder(Target(target), drafter, attention="absorbed")
    per_device = {"target_weights": target_bytes, "drafter_weights": drafter_bytes}
    return decoder, per_device, {"target": target_stored, "drafter": drafter_stored}


def _abstract_requests(decoder, mesh, config, drafter_config, budget: int, batch: int, slots: int):
    """A greedy DDTree request plan and the decode state it runs on, as sharded ShapeDtypeStructs."""
    block = drafter_config.block_size
    rng = jax.ShapeDtypeStruct((batch, 2), jnp.uint32)
    empty = lambda rng: DecodeState.empty(config, drafter_config, batch, slots, block, jnp.bfloat16, rng)
    state = jax.eval_shape(empty, rng)
    shardings = state_shardings(state, mesh)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
    requests = Requests(
        max_length=jax.ShapeDtypeStruct((batch,), jnp.int32),
        stop_ids=jax.ShapeDtypeStruct((batch, MAX_STOP_TOKENS), jnp.int32),
        sampling=jax.eval_shape(lambda: SamplingArrays.of([GREEDY] * batch)),
    )
    spec = decoder.round_spec("ddtree", block, budget)
    return RequestPlan(spec, batch, [1] * batch, requests), state


def _shard_bytes(x) -> int:
    """Bytes of one device's shard of an abstract array."""
    return _bytes(x, x.sharding.shard_shape(x.shape))


def _bytes(x, shape: tuple[int, ...] | None = None) -> int:
    return int(np.prod(x.shape if shape is None else shape, dtype=np.int64)) * x.dtype.itemsize


def report(result: dict[str, Any]) -> str:
    lines = [
        f"{result['config']}: {result['layers']} layers, routed experts {result['routed_experts']}, "
        f"{result['devices']} devices, MoE {result['moe']}, DDTree budget {result['budget']}, "
        f"batch {result['batch']}, max length {result['max_len']} ({result['cache_slots']} cache slots)",
        f"per round and device at {result['max_len']} tokens of context (the floor: bytes / bandwidth + link):",
        format_table(result["traffic"]),
    ]
    if "per_device_bytes" not in result:
        return "\n".join(lines)
    lines.append("per device:")
    lines += [f"  {name:<16} {value / GB:9.2f} GB" for name, value in result["per_device_bytes"].items()]
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
    parser.add_argument("--traffic", action="store_true", help="only the traffic account: no compile")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    # Simulated devices must exist before JAX starts its CPU backend.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax.config.update("jax_num_cpu_devices", max(args.devices, 1))
    options = (args.devices, args.moe, args.budget, args.max_len, args.batch, args.layers, not args.traffic)
    result = plan(args.config, args.drafter_config, *options)
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
