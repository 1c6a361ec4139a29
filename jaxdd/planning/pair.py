"""The full-size pair a plan weighs: its configs read from their files, and the target and
drafter built abstractly (shapes and shardings only, nothing allocated) on a mesh of a machine's
devices (this host's CPUs, or compile-only GPUs and TPUs from ``jaxdd.planning.aot``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdd.config import DrafterConfig, KimiConfig
from jaxdd.errors import ConfigError, read_json
from jaxdd.models.drafter import DFlashDrafter
from jaxdd.models.quant import ExpertFormat
from jaxdd.models.target import KimiTarget
from jaxdd.planning.capacity import shard_bytes
from jaxdd.runtime.sharding import param_shardings, place
from jaxdd.types import MoeMode
from jaxdd.weights.hf_quantization import declared_expert_format


def read_configs(
    config_path: str | Path, drafter_config_path: str | Path, layers: int | None = None
) -> tuple[KimiConfig, DrafterConfig, ExpertFormat]:
    """The target's and drafter's configs from their files (``layers``: both cut to that many
    target layers at full width) and how the target's checkpoint stores its routed experts."""
    raw = read_json(config_path, ConfigError, "config file")
    return *_model_configs(raw, drafter_config_path, layers), declared_expert_format(raw)


def _model_configs(
    raw: dict, drafter_config_path: str | Path, layers: int | None
) -> tuple[KimiConfig, DrafterConfig]:
    """The target's config from its parsed JSON and the drafter's; with ``layers``, both cut
    to that many target layers at full width (the drafter taps the layers that remain)."""
    config = KimiConfig.from_hf(raw)
    drafter_config = DrafterConfig.from_json_file(drafter_config_path)
    if layers is not None:
        config = dataclasses.replace(
            config,
            num_hidden_layers=layers,
            first_k_dense_replace=min(config.first_k_dense_replace, layers - 1),
        )
        taps = tuple(min(t, layers - 1) for t in drafter_config.target_layer_ids)
        drafter_config = dataclasses.replace(drafter_config, target_layer_ids=taps)
    return config, drafter_config


def abstract_models(
    config: KimiConfig,
    drafter_config: DrafterConfig,
    experts: ExpertFormat,
    mesh: jax.sharding.Mesh,
    moe: MoeMode,
    dtype: jnp.dtype = jnp.bfloat16,
) -> tuple[tuple[KimiTarget, DFlashDrafter], dict[str, int], dict[str, int]]:
    """The target and drafter as abstract models placed on a mesh (shapes and shardings only,
    nothing allocated), the bytes of parameters each device holds, and the bytes stored on all
    devices together."""

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
        return module, sum(shard_bytes(x) for x in leaves), sum(_bytes(x) for x in leaves)

    target, target_bytes, target_stored = abstract(
        lambda: KimiTarget(config, dtype, experts=experts, rngs=nnx.Rngs(0))
    )
    drafter, drafter_bytes, drafter_stored = abstract(
        lambda: DFlashDrafter(drafter_config, dtype, rngs=nnx.Rngs(0))
    )
    per_device = {"target_weights": target_bytes, "drafter_weights": drafter_bytes}
    return (target, drafter), per_device, {"target": target_stored, "drafter": drafter_stored}


def _bytes(x, shape: tuple[int, ...] | None = None) -> int:
    return int(np.prod(x.shape if shape is None else shape, dtype=np.int64)) * x.dtype.itemsize
