"""The latent cache's layout a run takes when none is asked (``generate`` and ``serve`` without
``--cache-layout``): ``jaxdd.plan``'s choice for the loaded models on the devices they run on.

The plan weighs the floors of the run's round in both layouts on its named hardware
(``choose_layout``); here the hardware is the one whose ``device_kind`` the devices report, and
the free memory the allocators' (the least over the processes, so that all choose alike). One
device, or devices with no hardware model (the simulated CPU devices), stay replicated, as the
plan says for them.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxdd.models.drafter import DFlashDrafter
from jaxdd.models.target import KimiTarget
from jaxdd.planning.cache_layout import LayoutChoice, choose_layout
from jaxdd.planning.capacity import (
    CACHE_MEMORY_FRACTION,
    cache_capacities,
    least_free_bytes,
    shard_bytes,
    slot_bytes,
)
from jaxdd.planning.hardware import GPUS, TPUS, Hardware
from jaxdd.planning.roofline import ModelWork
from jaxdd.planning.traffic import ModelBytes, PairAccount, PlannedRound
from jaxdd.runtime.sharding import mesh_of
from jaxdd.types import LAYOUTS, DrafterKV, Method

# what jax.Device.device_kind says on each TPU chip of ``TPUS`` (as JAX's own tests read it)
TPU_KINDS = {"TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p"}
TPU_KINDS |= {"TPU v6 lite": "v6e", "TPU v6e": "v6e"}


def hardware_of(device: jax.Device) -> Hardware | None:
    """The named hardware (``jaxdd.planning.hardware``) a device is, by its ``device_kind``."""
    kind = device.device_kind
    gpu = next((g for g in GPUS.values() if g.device_kind == kind), None)
    return gpu or TPUS.get(TPU_KINDS.get(kind, ""))


@dataclasses.dataclass(frozen=True)
class RunRound:
    """The round a run takes, as its caller gives it: a ``method`` round of ``batch`` rows at
    ``max_len`` tokens of context (``block``: default the drafter's; DDTree ``budget``: default
    block - 1, as the rounds take them)."""

    method: Method
    max_len: int
    batch: int = 1
    block: int | None = None
    budget: int | None = None


def default_layout(
    target: KimiTarget,
    drafter: DFlashDrafter | None,
    run: RunRound,
    drafter_kv: DrafterKV = "model",
) -> LayoutChoice:
    """The layout whose roofline of the ``run``'s round (the drafter's K/V stored as
    ``drafter_kv`` says) is lower on the devices ``target`` is placed on; striped where only its
    pages hold the rows in the devices' free memory (the least over the processes)."""
    method = run.method
    mesh = mesh_of(target)
    devices = 1 if mesh is None else mesh.size
    hardware = None if mesh is None else hardware_of(mesh.devices.flat[0])
    # AR drafts nothing and its pool holds no drafter K/V
    drafter_config = None if drafter is None or method == "ar" else drafter.config
    block = 1 if drafter_config is None else run.block or drafter_config.block_size
    planned = PlannedRound(method, block, run.budget or block - 1, run.batch, run.max_len)
    needed = planned.needed
    held = dict.fromkeys(LAYOUTS, needed)  # no memory limit known: neither layout is refused
    if devices == 1 or hardware is None:  # nothing to weigh: the plan says why
        return choose_layout(None, {}, held, needed, hardware, devices, planned.name)
    free = least_free_bytes(mesh)
    if free is not None:
        slot = slot_bytes(target.config, drafter_config, mesh, target.dtype, drafter_kv)
        capacities = cache_capacities(CACHE_MEMORY_FRACTION * free, slot, devices)
        held = {layout: capacity["tokens"] for layout, capacity in capacities.items()}
    model = ModelBytes.of(target, drafter, shard_bytes, drafter_kv)
    moe = target.placement[1] if target.placement is not None else "tp"
    work = ModelWork.of(target, drafter, shard_bytes)
    floors = planned.floors(PairAccount(target.config, model, work), devices, moe, hardware)
    return choose_layout(None, floors, held, needed, hardware, devices, planned.name)
