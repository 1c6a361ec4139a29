"""Synthetic mini checkpoints in the real Kimi layouts, quantized by the references' own code.

Each builder takes the tensors of a plain fp32 HF checkpoint (per-expert
names, as save_pretrained writes them) and writes one layout into a directory,
several shards plus an index, returning the *dequantized* fp32 tensors that an
HF model must hold to compute what the quantized checkpoint means.

- K2-Instruct / DeepSeek-V3: every Linear in FP8 e4m3 with fp32
  ``weight_scale_inv`` per 128 x 128 block (torch float8_e4m3fn; dequantized
  as DeepSeek's fp8_cast_bf16 does), the rest bf16, router bias fp32.
- K2.5 / K2.6: ``language_model.`` prefix, routed experts INT4 pack-quantized by
  compressed-tensors itself (``quantize`` + ``pack_to_int32``, group 32, bf16 scales,
  the QAT grid of +-7), everything else bf16, plus vision-tower and projector tensors
  and a stray rotary ``inv_freq`` buffer that conversion must skip.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from safetensors.torch import load_file, save_file

from jaxdd.testing.reference import TINY_K2

# hidden 160 = one full 128-block plus a partial one, so
# FP8 edge blocks are exercised (like 576-row kv_a_proj).
CONVERT_TINY = TINY_K2 | dict(hidden_size=160)

FP8_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
INT4_ARGS = QuantizationArgs(
    num_bits=4, type="int", symmetric=True, strategy="group", group_size=32
)
INT4_CONFIG = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
    ],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}


def read_plain(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, tensors) of a save_pretrained checkpoint."""
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors |= load_file(file)
    return json.loads((directory / "config.json").read_text()), tensors


def save_sharded(
    directory: Path, config: dict, tensors: dict[str, torch.Tensor], shards: int = 3
) -> Path:
    """config.json + ``shards`` safetensors files +
    model.safetensors.index.json, as HF hubs ship them."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    names = sorted(tensors)
    per_shard = math.ceil(len(names) / shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        chunk = {n: tensors[n].contiguous() for n in names[i * per_shard : (i + 1) * per_shard]}
        save_file(chunk, directory / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(chunk, file)
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
        "weight_map": weight_map,
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return directory


def is_linear(name: str) -> bool:
    return name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name


def deepseek_weight_dequant(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: int = 128
) -> torch.Tensor:
    """DeepSeek-V3 inference/fp8_cast_bf16.py semantics on
    CPU: per 128x128 tile, x.float() * s, stored bf16."""
    out_features, in_features = weight.shape
    scale = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[
        :out_features, :in_features
    ]
    return (weight.float() * scale).to(torch.bfloat16)


def fp8_quantize(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block absmax scaling to the e4m3 range (448), edge
    blocks zero-padded: (fp8 weight, fp32 scale_inv)."""
    rows, cols = weight.shape
    br = math.ceil(rows / block)
    bc = math.ceil(cols / block)
    padded = torch.zeros(br * block, bc * block)
    padded[:rows, :cols] = weight
    tiles = padded.reshape(br, block, bc, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    quantized = (tiles / scale[:, None, :, None]).reshape(br * block, bc * block)[:rows, :cols]
    return quantized.to(torch.float8_e4m3fn), scale.float()


def int4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """compressed-tensors group quantization (+-7 grid, bf16
    scales): (packed int32, scale bf16, int values)."""
    rows, cols = weight.shape
    scale = (
        (weight.reshape(rows, cols // 32, 32).abs().amax(-1) / 7.0)
        .clamp(min=1e-6)
        .to(torch.bfloat16)
    )
    values = quantize(
        weight, scale, torch.zeros_like(scale, dtype=torch.int8), INT4_ARGS, dtype=torch.int8
    )
    return pack_to_int32(values, 4), scale, values


def write_k2_instruct_fp8(plain_dir: Path, directory: Path) -> dict[str, torch.Tensor]:
    config, tensors = read_plain(plain_dir)
    stored = {}
    reference = {}
    for name, weight in tensors.items():
        if is_linear(name):
            quantized, scale_inv = fp8_quantize(weight)
            stored[name] = quantized
            stored[name + "_scale_inv"] = scale_inv
            reference[name] = deepseek_weight_dequant(quantized, scale_inv).float()
        elif name.endswith("e_score_correction_bias"):
            stored[name] = weight.float()
            reference[name] = stored[name]
        else:
            stored[name] = weight.to(torch.bfloat16)
            reference[name] = stored[name].float()
    save_sharded(
        directory, config | {"quantization_config": FP8_CONFIG, "dtype": "bfloat16"}, stored
    )
    return reference


def write_k25_int4(plain_dir: Path, directory: Path) -> dict[str, torch.Tensor]:
    config, tensors = read_plain(plain_dir)
    stored = {}
    reference = {}
    for name, weight in tensors.items():
        if is_routed_expert(name):
            packed, scale, values = int4_quantize(weight)
            base = "language_model." + name.removesuffix(".weight")
            stored[base + ".weight_packed"] = packed
            stored[base + ".weight_scale"] = scale
            stored[base + ".weight_shape"] = torch.tensor(list(weight.shape), dtype=torch.int32)
            reference[name] = dequantize(
                values, scale, None, args=INT4_ARGS, dtype=torch.bfloat16
            ).float()
        else:
            kept = (
                weight.float()
                if name.endswith("e_score_correction_bias")
                else weight.to(torch.bfloat16)
            )
            stored["language_model." + name] = kept
            reference[name] = kept.float()
    # Parts of the K2.5 wrapper that a text-only conversion skips.
    generator = torch.Generator().manual_seed(0)
    stored["vision_tower.patch_embed.proj.weight"] = torch.randn(
        8, 3, 2, 2, generator=generator
    ).bfloat16()
    stored["mm_projector.proj.0.weight"] = torch.randn(8, 8, generator=generator).bfloat16()
    stored["language_model.model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4).bfloat16()
    wrapper = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "quantization_config": INT4_CONFIG,
        "text_config": config | {"quantization_config": INT4_CONFIG},
        "vision_config": {"model_type": "moonvit", "hidden_size": 8},
    }
    save_sharded(directory, wrapper, stored, shards=4)
    return reference


def write_reference(plain_dir: Path, tensors: dict[str, torch.Tensor], directory: Path) -> Path:
    """A plain fp32 HF checkpoint holding ``tensors`` (what
    the quantized layouts mean), for from_pretrained."""
    config, _ = read_plain(plain_dir)
    return save_sharded(directory, config, {n: t.float() for n, t in tensors.items()}, shards=1)
