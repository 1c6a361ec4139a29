"""The fit planner behind ``python -m jaxdd.plan``: will a full-size
target + drafter fit a machine's devices, and how are the bytes spread?

Both models are built abstractly (shapes and shardings only, nothing allocated) on the machine's
devices (this host's CPUs, or compile-only GPUs and TPUs from ``jaxdd.planning.aot``), and the round
``jaxdd.generate`` would run there (the attention form and MoE dispatch the machine's platform
picks, its latent cache in the plan's layout) is compiled ahead of time by the machine's own
compiler. The result holds per device the weights as stored, the caches, the compiler's
temporaries and the verdict, the roofline of every round (``jaxdd.planning.traffic``) for
the latent cache replicated and striped (``cache_layout``), the context each layout's pages hold
(``capacity``) and what the compiled round moves (``compiled_traffic``) against the floor of its
layout.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
import traceback
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from jaxdd.api import Target
from jaxdd.cache import Paging
from jaxdd.cache.paging import PAGE_TOKENS
from jaxdd.config import DrafterConfig
from jaxdd.decoding.engine import RoundBatch, SpeculativeDecoder
from jaxdd.decoding.memory_maps import server_maps
from jaxdd.decoding.sampling import GREEDY, Sampling
from jaxdd.errors import InputError
from jaxdd.models.moe import MoE
from jaxdd.models.target import KimiTarget
from jaxdd.planning.aot import Machine, find_machine
from jaxdd.planning.cache_layout import LayoutChoice, choose_layout
from jaxdd.planning.capacity import (
    StateSpec,
    abstract_settings,
    abstract_state,
    cache_capacities,
    shard_bytes,
    slot_bytes,
)
from jaxdd.planning.compiled_traffic import compiled_traffic
from jaxdd.planning.hardware import named_hardware
from jaxdd.planning.pair import abstract_models, read_configs
from jaxdd.planning.roofline import ModelWork
from jaxdd.planning.traffic import (
    ModelBytes,
    PairAccount,
    PlannedRound,
    Spread,
    fastest_rounds,
    traffic_table,
)
from jaxdd.runtime.sharding import make_mesh
from jaxdd.types import (
    ATTENTION_CHOICES,
    DRAFTER_KVS,
    LAYOUTS,
    METHODS,
    MOE_MODES,
    AttentionChoice,
    CacheLayout,
    DrafterKV,
    Method,
    MoeMode,
    verified_tokens,
)


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """What one plan compiles: the hardware (``names()``),
    its devices, the MoE split and the round's shape."""

    hardware: str = "cpu"
    devices: int | None = None  # default: 8 GPUs, a TPU topology's chips, every CPU device
    moe: MoeMode = "tp"  # as jaxdd.generate's default
    method: Method = "ddtree"
    budget: int = 64
    max_len: int = 8192
    batch: int = 1
    layers: int | None = None  # full width, this many layers
    sampled: bool = False
    attention: AttentionChoice = "auto"
    compile_round: bool = True  # False: the traffic account only (seconds, not minutes)
    cache_layout: CacheLayout | None = None  # None: the layout with the faster floor
    drafter_kv: DrafterKV = "model"  # the dtype the drafter's context K/V is stored in

    def __post_init__(self) -> None:
        choices = {"method": METHODS, "moe": MOE_MODES, "attention": ATTENTION_CHOICES}
        choices["cache_layout"] = (None, *LAYOUTS)
        choices["drafter_kv"] = DRAFTER_KVS
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                listed = ", ".join(a for a in allowed if a is not None)
                raise InputError(
                    f"--{name.replace('_', '-')}: expected one of {listed}, "
                    f"got {getattr(self, name)!r}"
                )
        for name in ("devices", "budget", "max_len", "batch", "layers"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InputError(f"--{name.replace('_', '-')}: expected at least 1, got {value}")


@dataclasses.dataclass(frozen=True)
class _Planning:
    """What one plan fixes before it compiles: its options and round, the drafter's config, the
    pair's account, and the machine it plans for with its mesh."""

    options: PlanOptions
    planned: PlannedRound
    drafter_config: DrafterConfig
    pair: PairAccount
    where: Machine
    mesh: jax.sharding.Mesh


def plan(
    config_path: str | Path, drafter_config_path: str | Path, options: PlanOptions = PlanOptions()
) -> dict:
    """Compile one round (DDTree at ``budget`` by default) of the full-size pair ahead of time
    for the options' hardware, its latent cache in the plan's layout, and count its bytes per
    device, with the traffic account of AR / DFlash / DDTree rounds at ``max_len`` tokens of
    context (``jaxdd.planning.traffic``)."""
    o = options
    config, drafter_config, experts = read_configs(config_path, drafter_config_path, o.layers)
    where = find_machine(o.hardware, o.devices)
    mesh = make_mesh(len(where.devices), where.devices)
    form = where.backend.attention(o.attention)
    models, per_device, stored = abstract_models(config, drafter_config, experts, mesh, o.moe)
    block = 1 if o.method == "ar" else drafter_config.block_size
    tokens = verified_tokens(o.method, block, o.budget)
    model_bytes = ModelBytes.of(*models, shard_bytes, o.drafter_kv)
    work = ModelWork.of(*models, shard_bytes)
    devices = len(where.devices)
    planned = PlannedRound(o.method, block, o.budget, o.batch, o.max_len)
    pair = PairAccount(config, model_bytes, work)
    planning = _Planning(o, planned, drafter_config, pair, where, mesh)

    def layouts(activations: int | None, chosen: LayoutChoice | None = None) -> dict[str, Any]:
        """The latent cache's layout (``chosen``, else the plan's choice), its rounds and
        capacity (``_cache_layouts``), after ``activations`` bytes of compiled temporaries."""
        return _cache_layouts(planning, per_device, activations, chosen)

    def decoder_in(layout: CacheLayout) -> tuple[SpeculativeDecoder, Paging]:
        """The decoder whose latent cache is laid out so, and its batch's paging."""
        decoder = SpeculativeDecoder(
            Target(models[0]),
            models[1],
            attention=form,
            cache_layout=layout,
            drafter_kv=o.drafter_kv,
        )
        # sized as the runtime sizes a row for requests of up to ``max_len`` tokens
        return decoder, Paging.for_rows(decoder.stripes, o.batch, 0, o.max_len, max(block, tokens))

    accounted = layouts(None)
    layers = (config.num_hidden_layers, 0 if o.method == "ar" else drafter_config.num_hidden_layers)
    decoder, paging = decoder_in(accounted["cache_layout"])
    shape = {
        "config": str(config_path),
        "layers": config.num_hidden_layers,
        "routed_experts": experts.kind,
        "hardware": _describe(where),
        "devices": devices,
        "moe": o.moe,
        "method": o.method,
        "sampled": o.sampled,
        "budget": o.budget,
        "max_len": o.max_len,
        "cache_slots": paging.slots,
        "drafter_kv": o.drafter_kv,
        "batch": o.batch,
        "attention": form,
        "dispatch": _dispatch(models[0], tokens * o.batch, devices, o.moe, where),
        # on a CPU host, a server of this batch and length against the process's memory maps
        "memory_maps": server_maps(o.method, o.batch, o.max_len, layers, where.platform),
    }
    if not o.compile_round:
        return shape | accounted

    def compiled_in(decoder: SpeculativeDecoder, paging: Paging) -> tuple[Any, dict, dict | None]:
        """The round's decode state, its compile's analysis and its traffic account."""
        round_batch, state = _abstract_requests(decoder, planning, paging)
        return state, *_compile(decoder, round_batch, state, where, form)

    state, compiled, account = compiled_in(decoder, paging)
    checked = layouts(compiled["temp_bytes"])
    if checked["cache_layout"] != accounted["cache_layout"]:
        # the round's temporaries leave only the other layout holding the batch
        decoder, paging = decoder_in(checked["cache_layout"])
        shape["cache_slots"] = paging.slots
        state, compiled, account = compiled_in(decoder, paging)
        choice = LayoutChoice(checked["cache_layout"], checked["cache_layout_reason"])
        checked = layouts(compiled["temp_bytes"], choice)
    shape |= checked
    for name, cache in (("target_cache", state.target_cache), ("drafter_cache", state.draft_cache)):
        per_device[name] = sum(shard_bytes(x) for x in jax.tree.leaves(cache))
    per_device["temporaries"] = compiled["temp_bytes"]
    if account is not None:
        spread = Spread(devices, o.moe, shape["cache_layout"])
        floor = planned.traffic(PairAccount(config, model_bytes), spread)
        shape["compiled_traffic"] = _against_floor(account, floor)
    return shape | _verdict(per_device, compiled, where, stored)


def _cache_layouts(
    planning: _Planning,
    per_device: dict[str, int],
    activations: int | None,
    chosen: LayoutChoice | None = None,
) -> dict[str, Any]:
    """The traffic account of the latent cache's layout (``chosen``, else ``--cache-layout``,
    else the faster roofline of the plan's round at its batch on its hardware), both layouts'
    rounds, the round with the most tokens/s per GPU in it, and the context tokens each layout
    holds in the memory left after the weights and (when compiled) the temporaries."""
    o, planned, where, pair = planning.options, planning.planned, planning.where, planning.pair
    devices = len(where.devices)
    weights = per_device["target_weights"] + per_device["drafter_weights"]
    free = where.memory - weights - (activations or 0)
    # AR's pool holds no drafter K/V
    drafted = None if o.method == "ar" else planning.drafter_config
    slot = slot_bytes(pair.config, drafted, planning.mesh, drafter_kv=o.drafter_kv)
    capacity = cache_capacities(free, slot, devices)
    hardware = named_hardware(where.name)
    floors = planned.floors(pair, devices, o.moe, hardware)
    held = {name: c["tokens"] for name, c in capacity.items()}
    choice = chosen or choose_layout(
        o.cache_layout, floors, held, planned.needed, hardware, devices, planned.name
    )
    block = planning.drafter_config.block_size
    by_layout = {
        name: traffic_table(pair, Spread(devices, o.moe, name), o.max_len, block)
        for name in LAYOUTS
    }
    return {
        "traffic": by_layout[choice.layout],
        "cache_layout": choice.layout,
        "cache_layout_reason": choice.reason,
        "fastest_round": fastest_rounds(by_layout[choice.layout]),
        "cache_capacity_tokens": held[choice.layout],
        "cache_capacity": {
            "memory_bytes": where.memory,
            "weights_bytes": weights,
            "activations_bytes": activations or 0,
            "activations": "compiled temporaries" if activations is not None else "not compiled",
            "free_bytes": free,
            "page_tokens": PAGE_TOKENS,
            "slot_bytes": slot,
            **capacity,
        },
        "traffic_by_layout": by_layout,
    }


def _against_floor(account: dict[str, Any], floor: dict[str, Any]) -> dict[str, Any]:
    """What the compiled round moves, next to the traffic floor of the same round (its layout's:
    a striped round's merge is the scheme that sends the fewest bytes)."""
    merge = min(
        floor.get("merges", {}).values(),
        key=lambda cost: cost["bytes"],
        default={"bytes": 0, "collectives": 0},
    )
    # reads, and all-reduces and the merge sent + received
    floor_bytes = floor["read_total"] + 2 * (floor["allreduce_bytes"] + merge["bytes"])
    keys = ("weights", "experts", "kv", "drafter", "drafter_kv", "allreduce_bytes", "allreduces")
    return account | {
        "floor_bytes": round(floor_bytes),
        "floor": {k: round(floor[k]) for k in keys}
        | {"merge_bytes": round(merge["bytes"]), "merge_collectives": merge["collectives"]},
        "ratio": round(account["bytes"] / floor_bytes, 3),
    }


def _verdict(
    per_device: dict[str, int],
    compiled: dict[str, Any],
    where: Machine,
    stored: int,
) -> dict[str, Any]:
    """The per-device byte total of the compiled round and whether it fits the machine's
    memory (the compiler's own figure where it ran out)."""
    used = compiled.get("used_bytes")
    total = sum(per_device.values()) if used is None else used
    return {
        "per_device_bytes": per_device | {"total": total},
        "compiled": compiled,
        "fits": bool(compiled["fits_compiler"] and total <= where.memory),
        # JAX preallocates this fraction of each GPU (0.75
        # unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise)
        "memory_fraction": math.ceil(100 * total / where.memory) / 100,
        "stored_bytes": stored,  # all devices together
    }


def _describe(where: Machine) -> dict[str, Any]:
    return {
        "name": where.name,
        "platform": where.platform,
        "device_kind": where.devices[0].device_kind,
        "memory_bytes": where.memory,
        "processes": where.processes,
        "source": where.description,
    }


def _dispatch(model: KimiTarget, tokens: int, devices: int, moe: str, where: Machine) -> str | None:
    """The MoE dispatch the round's MoE layers run (over one device's experts under EP)."""
    layer = next((m for _, m in nnx.iter_modules(model) if isinstance(m, MoE)), None)
    if layer is None:
        return None
    experts = layer.config.n_routed_experts
    local = experts // devices if moe == "ep" and layer.placement is not None else experts
    return layer.dispatch_for(tokens, local, where.backend)


def _compile(decoder, round_batch, state, where: Machine, form: str) -> dict[str, Any]:
    """Compile the round for ``where``: its memory analysis, or what the compiler said it
    needs when it ran out of memory (RESOURCE_EXHAUSTED, raised inside the compile on TPU)."""
    start = time.perf_counter()
    try:
        lowered = decoder.lower_round(round_batch, state)
        compiled = lowered.compile(compiler_options=where.compiler_options or None)
    except Exception as error:
        needed = _exhausted(str(error)) if isinstance(error, jax.errors.JaxRuntimeError) else None
        if needed is not None:
            return {
                "fits_compiler": False,
                "temp_bytes": 0,
                **needed,
                "compile_seconds": _since(start),
            }, None
        if form == "pallas" and _from_pallas(error):
            raise InputError(
                f"--hardware {where.name}: the Pallas tree-attention kernel does not compile "
                f"for it ({type(error).__name__}: {str(error).strip().splitlines()[0][:200]}); "
                "--attention absorbed compiles XLA's attention instead"
            ) from None
        raise
    memory = compiled.memory_analysis()
    analysis = {
        "fits_compiler": True,
        "argument_bytes": int(memory.argument_size_in_bytes),
        "output_bytes": int(memory.output_size_in_bytes),
        "alias_bytes": int(memory.alias_size_in_bytes),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "compile_seconds": _since(start),
    }
    return analysis, compiled_traffic(compiled, weight_names(decoder))


def weight_names(decoder: SpeculativeDecoder) -> dict[str, str]:
    """The round's weight arguments (``models.target_weights[i]``, as the HLO's
    parameters name them) by the model's own paths (``target/layers/0/mlp/gate``)."""
    names = {}
    for side, module in (("target", decoder.target.model), ("drafter", decoder.drafter)):
        leaves = jax.tree_util.tree_flatten_with_path(nnx.split(module)[1])[0]
        for i, (path, _) in enumerate(leaves):
            keys = [str(getattr(k, "key", getattr(k, "idx", k))).strip(".") for k in path]
            names[f"models.{side}_weights[{i}]"] = "/".join(
                [side, *(k for k in keys if k != "value")]
            )
    return names


def _since(start: float) -> float:
    return round(time.perf_counter() - start, 1)


_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = r"([0-9.]+)([KMGT])"


def _exhausted(message: str) -> dict[str, int] | None:
    """What an out-of-memory compile error says was needed: XLA:TPU's "the total
    memory required for HLO temporaries (35.32G) exceeds available HBM (15.75G)"
    (``temp_bytes``) or "Used 120.5G of 95.7G hbm" (``used_bytes``, everything);
    None for another error (a kernel over its on-chip memory among them)."""
    if "RESOURCE_EXHAUSTED" not in message or "Shared memory" in message:
        return None
    size = lambda found: int(float(found.group(1)) * _UNITS[found.group(2)])
    if found := re.search(rf"temporaries \({_SIZE}\)", message):
        return {"temp_bytes": size(found)}
    if found := re.search(rf"Used {_SIZE} of", message):
        return {"used_bytes": size(found)}
    return {}


def _from_pallas(error: BaseException) -> bool:
    """Whether a compile error came from a Pallas kernel: raised in jax's pallas package (its
    lowering rules), or naming Mosaic, Pallas or a GPU's shared memory (only kernels ask for it)."""
    frames = traceback.extract_tb(error.__traceback__)
    text = f"{error}".lower()
    words = ("mosaic", "pallas", "shared memory")
    return any(w in text for w in words) or any("/pallas/" in f.filename for f in frames)


def _abstract_requests(
    decoder: SpeculativeDecoder, planning: _Planning, paging: Paging
) -> tuple[RoundBatch, Any]:
    """A request plan for the plan's round and the decode state it runs on, paged as
    ``paging`` says, its latent cache laid out as the decoder's, as sharded ShapeDtypeStructs."""
    o, block, batch = planning.options, planning.planned.block, planning.options.batch
    # as the runtime: AR holds no drafter K/V
    drafted = None if o.method == "ar" else planning.drafter_config
    layout = {"stripes": decoder.stripes, "drafter_kv": decoder.drafter_kv}
    spec = StateSpec(planning.pair.config, drafted, block, **layout)
    state = abstract_state(spec, batch, paging, planning.mesh)
    sampling = Sampling(temperature=1.0) if o.sampled else GREEDY
    settings = abstract_settings(batch, state.target_cache.pages.shape[-1], sampling)
    budget = o.budget if o.method == "ddtree" else None
    round_spec = decoder.round_spec(o.method, block, budget, sampled=o.sampled)
    return RoundBatch(round_spec, settings), state
