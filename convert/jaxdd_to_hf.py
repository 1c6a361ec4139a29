"""jaxdd checkpoint -> HF layout (config.json + safetensors shards + index), one group at a time.

The output loads with transformers' ``DeepseekV3ForCausalLM.from_pretrained``
(targets) and z-lab ``DFlashDraftModel.from_pretrained`` (drafters), so weights
made or changed in JAX can be checked against the PyTorch references. Quantized
routed experts are written dequantized, exactly as jaxdd computes with them.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file
from tqdm import tqdm

from jaxdd.config import DrafterConfig, KimiConfig
from jaxdd.errors import CheckpointError, ConfigError, checkpoint_directory, read_json
from jaxdd.models.quant import ExpertFormat, dense_experts
from jaxdd.weights.atomic import atomic_directory
from jaxdd.weights.checkpoint import (
    MARKER,
    abstract_model,
    check_files,
    get_path,
    group_path,
    is_jaxdd_checkpoint,
    read_meta,
    restore_groups,
)
from jaxdd.weights.hf_mappings import Mapping, drafter_mappings, target_mappings
from jaxdd.weights.hf_reader import INDEX_FILE
from jaxdd.weights.tokenizer import tokenizer_files

FP32_TENSORS = ("e_score_correction_bias",)  # fp32 in the real checkpoints whatever the model dtype


def export(
    source_dir: str | Path, output_dir: str | Path, dtype: str | None = None, progress: bool = True
) -> Path:
    """Write the HF layout of a jaxdd target or drafter
    checkpoint; ``dtype`` defaults to the stored one."""
    source_dir = checkpoint_directory(source_dir)
    if not is_jaxdd_checkpoint(source_dir):
        raise CheckpointError(
            f"{source_dir}: not a jaxdd checkpoint (no {MARKER}); hf-to-jaxdd converts HF ones"
        )
    kind = read_json(source_dir / MARKER).get("kind")
    meta = read_meta(source_dir, kind)
    check_files(source_dir, kind)
    dtype = jnp.dtype(dtype or meta["dtype"])
    config = read_json(source_dir / "config.json", ConfigError)
    if kind == "target":
        experts = ExpertFormat.from_json(meta.get("experts", {}))
        mappings = list(target_mappings(KimiConfig.from_hf(config), experts=ExpertFormat()))
    else:
        experts = ExpertFormat()
        mappings = list(drafter_mappings(DrafterConfig.from_hf(config)))
    abstract = nnx.to_pure_dict(abstract_model(source_dir, kind)[1])
    groups = meta["groups"]
    weight_map: dict[str, str] = {}
    total_size = 0
    start = time.perf_counter()
    with (
        atomic_directory(output_dir) as staging,
        contextlib.closing(restore_groups(source_dir, abstract)) as restored,
    ):
        for i, (group, tree) in enumerate(
            tqdm(restored, total=len(groups), desc="exporting", disable=not progress)
        ):
            prefix = group_path(group)
            tree = _dense_experts(tree, experts, dtype)
            shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            tensors = {}
            for mapping in (m for m in mappings if m.paths[0][: len(prefix)] == prefix):
                tensors.update(_hf_tensors(mapping, tree, prefix, dtype))
            save_file(tensors, staging / shard, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, shard))
            total_size += sum(t.nbytes for t in tensors.values())
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (staging / INDEX_FILE).write_text(json.dumps(index, indent=2))
        (staging / "config.json").write_text(json.dumps(config | {"dtype": dtype.name}, indent=2))
        for file in tokenizer_files(source_dir):
            shutil.copyfile(file, staging / file.name)
    if progress:
        print(
            f"exported {len(weight_map)} tensors, {total_size / 1e6:.1f} MB in "
            f"{time.perf_counter() - start:.1f} s"
        )
    return Path(output_dir).absolute()


def _dense_experts(tree, experts: ExpertFormat, dtype: jnp.dtype):
    """Replace quantized expert pieces by their dense [E,
    in, out] weights (what the model computes with)."""
    if experts.kind == "dense" or not isinstance(tree, dict) or "router" not in tree.get("mlp", {}):
        return tree  # nothing quantized, or not an MoE layer
    pieces = ("packed", "scale") if experts.kind == "int4" else ("weight", "scale_inv")
    for proj in ("gate", "up", "down"):
        stored = tree["mlp"][proj]
        tree["mlp"][proj] = {"weight": dense_experts(experts, *(stored[p] for p in pieces), dtype)}
    return tree


def _hf_tensors(mapping: Mapping, tree, prefix: tuple, dtype: jnp.dtype) -> dict[str, np.ndarray]:
    arrays = [
        jax.device_get(get_path({"v": tree}, ("v", *path[len(prefix) :]))) for path in mapping.paths
    ]
    out = {}
    for name, array in zip(mapping.names, mapping.backward(*arrays), strict=True):
        target = np.float32 if name.endswith(FP32_TENSORS) else dtype
        out[name] = np.ascontiguousarray(np.asarray(array).astype(target))
    return out
