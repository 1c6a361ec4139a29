"""The latent cache's layout a run takes when none is asked (``generate`` and ``serve`` without
``--cache-layout``): ``jaxdd.plan``'s choice for the loaded models on the devices they run on.

The plan weighs the floors of the run's round in both layouts on its named hardware
(``choose_layout``); here the hardware is the one whose ``device_kind`` the devices report, and
the free memory the allocators' (the least over the processes, so that all choose alike). One
device, or devices with no hardware model (the simulated CPU devices), stay replicated, as the
plan says for them.
"""

from __future__ import annotations

import jax

from jaxdd.models.drafter import DFlashDrafter
from jaxdd.models.target import KimiTarget
from jaxdd.planning.cache_layout import LayoutChoice, choose_layout, round_name
from jaxdd.planning.capacity import (
    CACHE_MEMORY_FRACTION,
    cache_capacity,
    least_free_bytes,
    shard_bytes,
    slot_bytes,
)
from jaxdd.planning.hardware import GPUS, TPUS, Hardware
from jaxdd.planning.traffic import ModelBytes, floor_seconds, round_traffic
from jaxdd.runtime.sharding import mesh_of
from jaxdd.types import LAYOUTS, Method, verified_tokens

# what jax.Device.device_kind says on each TPU chip of ``TPUS`` (as JAX's own tests read it)
TPU_KINDS = {"TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p"}
TPU_KINDS |= {"TPU v6 lite": "v6e", "TPU v6e": "v6e"}


def hardware_of(device: jax.Device) -> Hardware | None:
    """The named hardware (``jaxdd.planning.hardware``) a device is, by its ``device_kind``."""
    kind = device.device_kind
    gpu = next((g for g in GPUS.values() if g.device_kind == kind), None)
    return gpu or TPUS.get(TPU_KINDS.get(kind, ""))


def default_layout(
    target: KimiTarget,
    drafter: DFlashDrafter | None,
    method: Method,
    max_len: int,
    batch: int = 1,
    block: int | None = None,
    budget: int | None = None,
) -> LayoutChoice:
    """The layout whose floor of a ``method`` round of ``batch`` rows at ``max_len`` tokens of
    context (``block``: default the drafter's; DDTree ``budget``: default block - 1, as the
    rounds take them) is lower on the devices ``target`` is placed on; striped where only its
    pages hold the rows in the devices' free memory (the least over the processes)."""
    mesh = mesh_of(target)
    devices = 1 if mesh is None else mesh.size
    hardware = None if mesh is None else hardware_of(mesh.devices.flat[0])
    drafter_config = None if drafter is None else drafter.config
    if method == "ar" or drafter_config is None:
        block = 1
    block = block or drafter_config.block_size
    budget = budget or block - 1
    needed = batch * max_len
    held = dict.fromkeys(LAYOUTS, needed)  # no memory limit known: neither layout is refused
    name = round_name(method, budget, batch)
    if devices == 1 or hardware is None:  # nothing to weigh: the plan says why
        return choose_layout(None, {}, held, needed, hardware, devices, name)
    free = least_free_bytes(mesh)
    if free is not None:
        slot = slot_bytes(target.config, drafter_config, mesh, target.dtype)
        share = CACHE_MEMORY_FRACTION * free
        held = {lay: cache_capacity(share, slot, devices, lay)["tokens"] for lay in LAYOUTS}
    tokens = verified_tokens(method, block, budget)
    model = ModelBytes.of(target, drafter, shard_bytes)
    moe = target.placement[1] if target.placement is not None else "tp"
    draft = 0 if method == "ar" else block
    floors = {
        layout: floor_seconds(
            round_traffic(
                method, tokens, target.config, model, max_len, devices, moe, draft, layout, batch
            ),
            hardware,
        )["round_s"]
        for layout in LAYOUTS
    }
    return choose_layout(None, floors, held, needed, hardware, devices, name)
