"""Loading an HF checkpoint's tensors into jaxdd parameters, for the Kimi target and the DFlash
drafter, through the tables in ``jaxdd.weights.hf_mappings``: whole, or each device's part alone
(``jaxdd.weights.hf_reader`` reads and checks the files)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdd.config import DrafterConfig, KimiConfig, in_file
from jaxdd.models.drafter import DFlashDrafter, abstract_drafter
from jaxdd.models.quant import ExpertFormat
from jaxdd.models.target import KimiTarget, abstract_target
from jaxdd.runtime.sharding import Placement, abstract_shardings, place
from jaxdd.weights.checkpoint import get_path, set_path
from jaxdd.weights.hf_mappings import Mapping, drafter_mappings, target_mappings
from jaxdd.weights.hf_reader import HFCheckpoint


def load_hf_target(
    directory: str | Path,
    dtype: jnp.dtype = jnp.bfloat16,
    experts: ExpertFormat | None = None,
    placement: Placement | None = None,
) -> KimiTarget:
    """A ``KimiTarget`` from an HF checkpoint directory;
    every tensor is checked against the config first.

    experts: how to hold the routed experts; default as the checkpoint stores
    them (INT4 / FP8 stay quantized). placement: (mesh, MoE mode) to load
    straight into their shardings: this process reads from disk only its devices'
    parts (on a mesh of several hosts, only its own share of the checkpoint).
    """
    source = HFCheckpoint(directory)
    config = in_file(source.config_path, KimiConfig.from_hf, source.raw_config)
    experts = source.stored_expert_format() if experts is None else experts
    mappings = list(target_mappings(config, experts))
    source.check(mappings, ignored=mtp_layers(config))
    return _fill(source, mappings, abstract_target(config, dtype, experts), placement)


def load_hf_drafter(
    directory: str | Path, dtype: jnp.dtype = jnp.bfloat16, placement: Placement | None = None
) -> DFlashDrafter:
    """A ``DFlashDrafter`` from a z-lab DFlash checkpoint directory
    (config.json + safetensors); ``placement`` as in ``load_hf_target``."""
    source = HFCheckpoint(directory)
    config = in_file(source.config_path, DrafterConfig.from_hf, source.raw_config)
    mappings = list(drafter_mappings(config))
    source.check(mappings)
    return _fill(source, mappings, abstract_drafter(config, dtype), placement)


def mtp_layers(config: KimiConfig) -> Callable[[str], bool]:
    """DeepSeek-V3's multi-token-prediction layers (beyond
    num_hidden_layers) are not part of the target."""
    return lambda name: (
        name.startswith("model.layers.") and int(name.split(".")[2]) >= config.num_hidden_layers
    )


def convert_arrays(
    source: HFCheckpoint, mapping: Mapping, abstract: dict
) -> Iterator[tuple[tuple, np.ndarray]]:
    """(path, array) for each jaxdd parameter of
    ``mapping``, in the dtype of the abstract parameter."""
    arrays = mapping.forward(*source.read(mapping))
    for path, array in zip(mapping.paths, arrays, strict=True):
        yield path, np.asarray(array).astype(get_path(abstract, path).dtype, copy=False)


def _fill(
    source: HFCheckpoint, mappings: list[Mapping], abstract_model, placement: Placement | None
) -> nnx.Module:
    graphdef, abstract = abstract_model
    values = nnx.to_pure_dict(abstract)
    if placement is None:
        for mapping in mappings:
            for path, array in convert_arrays(source, mapping, values):
                set_path(values, path, jnp.asarray(array))
    else:
        shardings = abstract_shardings(graphdef, abstract, *placement)
        for mapping in mappings:
            for k, path in enumerate(mapping.paths):
                leaf = get_path(values, path)
                part = functools.partial(_part, source, mapping, k, leaf.shape, leaf.dtype)
                set_path(
                    values,
                    path,
                    jax.make_array_from_callback(leaf.shape, get_path(shardings, path), part),
                )
    nnx.replace_by_pure_dict(abstract, values)
    model = nnx.merge(graphdef, abstract)
    if placement is not None:
        place(model, *placement)
    return model


def _part(
    source: HFCheckpoint, mapping: Mapping, k: int, shape: tuple, dtype, index: tuple
) -> np.ndarray:
    return np.asarray(source.read_part(mapping, k, index, shape)).astype(dtype, copy=False)
