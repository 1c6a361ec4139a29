"""What an HF config declares about its quantized weights: the ``quantization_config`` block
and the routed experts' stored format (INT4 groups, FP8 blocks or dense), read from the config
alone so that planning needs no tensors."""

from __future__ import annotations

from typing import Any

from jaxdd.errors import CheckpointError
from jaxdd.models.quant import DENSE, ExpertFormat


def quantization_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The ``quantization_config`` block of an HF config
    (top level, or K2.5's ``text_config``), or {}."""
    return (
        raw.get("quantization_config")
        or (raw.get("text_config") or {}).get("quantization_config")
        or {}
    )


def declared_expert_format(raw: dict[str, Any]) -> ExpertFormat:
    """How a config says its routed experts are stored (for planning without the tensors);
    the quantized Kimi and DeepSeek-V3 checkpoints store their routers' gates in bf16."""
    q = quantization_config(raw)
    if q.get("quant_method") == "compressed-tensors":
        return ExpertFormat("int4", group=int4_group(q), router="bfloat16")
    if q.get("quant_method") == "fp8":
        return ExpertFormat("fp8", block=fp8_block(q), router="bfloat16")
    return DENSE


def int4_group(quantization: dict[str, Any]) -> int:
    for group in (quantization.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if (
            weights.get("num_bits") != 4
            or weights.get("strategy") != "group"
            or not weights.get("symmetric")
        ):
            raise CheckpointError.at(
                "quantization_config", f"only symmetric 4-bit groups are supported, got {weights}"
            )
        return int(weights["group_size"])
    return 32


def fp8_block(quantization: dict[str, Any]) -> int:
    block = quantization.get("weight_block_size", [128, 128])
    if len(block) != 2 or block[0] != block[1]:
        raise CheckpointError.at(
            "quantization_config.weight_block_size", f"expected square blocks, got {block}"
        )
    return int(block[0])
