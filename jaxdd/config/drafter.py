"""A DFlash drafter's configuration (z-lab ``DFlashDraftModel``), read from its ``config.json``
and checked against the target it drafts for."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxdd.config.fields import FieldReader, in_file, read_config_json
from jaxdd.config.rope import YarnConfig, parse_rope
from jaxdd.config.target import KimiConfig
from jaxdd.errors import ConfigError


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab dflash ``build_target_layer_ids``: spread
    the taps over layers 1 .. L-3 (Python's round)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start = 1
    end = num_target_layers - 3
    span = end - start
    return tuple(round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A DFlash drafter (z-lab ``DFlashDraftModel``):
    Qwen3-style layers fed with tapped target features."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    yarn: YarnConfig | None
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # z-lab configs state it; the drafter uses the target's embedding and lm_head
    vocab_size: int | None = None

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> DrafterConfig:
        r = FieldReader(config, "")
        # dflash reads these from dflash_config first, then from the top level (``_draft_value``).
        extra = config.get("dflash_config") or {}
        if not isinstance(extra, Mapping):
            raise r.fail("dflash_config", f"expected an object, got {extra!r}")
        merged = dict(config) | dict(extra)
        m = FieldReader(merged, "")
        r.equal("hidden_act", "silu", default="silu")
        r.equal("attention_bias", False, default=False)
        layers = r.positive("num_hidden_layers")
        layer_types = config.get("layer_types") or ["full_attention"] * layers
        if any(kind != "full_attention" for kind in layer_types) or config.get("is_causal"):
            raise r.fail(
                "layer_types",
                f"only non-causal full-attention drafters are supported, got {layer_types}",
            )
        heads = r.positive("num_attention_heads")
        hidden = r.positive("hidden_size")
        rope_theta, yarn = parse_rope(config, r, hf_defaults=True)
        if "target_layer_ids" in merged:
            taps = tuple(m.get("target_layer_ids", list))
        else:
            taps = default_target_layer_ids(r.positive("num_target_layers"), layers)
        if not taps or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in taps):
            raise r.fail(
                "dflash_config.target_layer_ids",
                f"expected non-negative layer indices, got {list(taps)}",
            )
        if "mask_token_id" not in merged:
            raise r.fail("dflash_config.mask_token_id", "missing")
        softcap = m.get("final_logit_softcapping", float, None)
        cfg = cls(
            hidden_size=hidden,
            intermediate_size=r.positive("intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=r.get("num_key_value_heads", int, heads),
            head_dim=r.get("head_dim", int, hidden // heads),
            rms_norm_eps=r.get("rms_norm_eps", float),
            rope_theta=rope_theta,
            yarn=yarn,
            block_size=m.get("block_size", int, 16),
            mask_token_id=m.get("mask_token_id", int),
            target_layer_ids=taps,
            input_embedding_scale=m.get("input_embedding_scale", float, 1.0),
            output_multiplier=m.get("output_multiplier", float, 1.0),
            final_logit_softcapping=softcap if softcap else None,
            vocab_size=r.get("vocab_size", int, None),
        )
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise r.fail(
                "num_key_value_heads", f"{cfg.num_key_value_heads} does not divide {heads} heads"
            )
        if cfg.block_size < 2:
            raise r.fail(
                "block_size",
                f"must be >= 2 (the bonus token plus at least one draft), got {cfg.block_size}",
            )
        return cfg

    @classmethod
    def from_json_file(cls, path: str | Path) -> DrafterConfig:
        return in_file(path, cls.from_hf, read_config_json(path))

    def check_fits(self, target: KimiConfig) -> None:
        """Raise ConfigError unless this drafter can draft for ``target``."""
        if self.hidden_size != target.hidden_size:
            raise ConfigError(
                f"drafter hidden_size {self.hidden_size} != target hidden_size "
                f"{target.hidden_size} "
                "(the drafter reads the target's embeddings and feeds its lm_head)"
            )
        if self.vocab_size is not None and self.vocab_size != target.vocab_size:
            raise ConfigError(
                f"drafter vocab_size {self.vocab_size} != target vocab_size "
                f"{target.vocab_size} (a drafter for "
                "another target: it drafts with this target's embeddings and lm_head)"
            )
        bad = [i for i in self.target_layer_ids if i >= target.num_hidden_layers]
        if bad:
            raise ConfigError(
                f"drafter target_layer_ids {list(bad)} outside the target's "
                f"{target.num_hidden_layers} layers"
            )
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ConfigError(
                f"drafter mask_token_id {self.mask_token_id} outside the vocabulary [0, "
                f"{target.vocab_size})"
            )
