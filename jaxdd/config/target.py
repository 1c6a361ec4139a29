"""The target's configuration: a frozen dataclass read from an HF ``config.json``.

Kimi K2-Instruct / K2-Thinking (``kimi_k2``) and DeepSeek-V3 (``deepseek_v3``) keep the
text-model fields at the top level; Kimi K2.5 / K2.6 (``kimi_k25``) wrap them in
``text_config`` next to a vision config we ignore. Every numeric value comes from the
file: Kimi releases differ in YaRN factor, beta_fast and rms_norm_eps, so nothing is
hard-coded here. A missing or inconsistent field raises ``ConfigError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxdd.config.fields import FieldReader, in_file, read_config_json
from jaxdd.config.rope import YarnConfig, parse_rope, yarn_mscale
from jaxdd.errors import ConfigError

TEXT_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
WRAPPER_MODEL_TYPES = ("kimi_k25",)


@dataclasses.dataclass(frozen=True)
class KimiConfig:
    """The text model of a Kimi K2.x / DeepSeek-V3 checkpoint (DeepseekV3ForCausalLM)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int
    moe_layer_freq: int
    rms_norm_eps: float
    rope_theta: float
    rope_interleave: bool
    yarn: YarnConfig | None
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None

    # The q_a / kv_a norms are built as RMSNorm(rank) with the default eps
    # in HF, Moonshot and DeepSeek's own code, not with config.rms_norm_eps
    # (vLLM/SGLang differ; K2.5's 1e-5 makes the difference visible).
    latent_norm_eps: float = 1e-6

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """q_head_dim^-0.5, times YaRN's mscale(factor,
        mscale_all_dim)^2 (HF DeepseekV3Attention)."""
        scale = self.qk_head_dim**-0.5
        if self.yarn is not None and self.yarn.mscale_all_dim:
            m = yarn_mscale(self.yarn.factor, self.yarn.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> KimiConfig:
        """Build from a parsed HF config.json dict (top-level
        text config or a ``kimi_k25`` wrapper)."""
        return _parse(config)

    @classmethod
    def from_json_file(cls, path: str | Path) -> KimiConfig:
        return in_file(path, cls.from_hf, read_config_json(path))

    def to_hf(self) -> dict[str, Any]:
        """The equivalent HF ``deepseek_v3`` config dict
        (what transformers' DeepseekV3Config accepts)."""
        d: dict[str, Any] = {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "num_key_value_heads": self.num_attention_heads,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "attention_bias": False,
            "eos_token_id": self.eos_token_ids[0]
            if len(self.eos_token_ids) == 1
            else list(self.eos_token_ids),
        }
        for f in dataclasses.fields(self):
            if f.name not in ("model_type", "yarn", "eos_token_ids", "latent_norm_eps"):
                d[f.name] = getattr(self, f.name)
        if self.yarn is not None:
            d["rope_scaling"] = {"type": "yarn", **dataclasses.asdict(self.yarn)}
        return d


def _parse(raw: Mapping[str, Any]) -> KimiConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type in WRAPPER_MODEL_TYPES:
        text = raw.get("text_config")
        if not isinstance(text, Mapping):
            raise ConfigError.at(
                "text_config", f"missing or not an object (required for model_type {model_type!r})"
            )
        inner = text.get("model_type", "deepseek_v3")
        if inner not in TEXT_MODEL_TYPES:
            raise ConfigError.at(
                "text_config.model_type",
                f"unsupported {inner!r}, expected one of {TEXT_MODEL_TYPES}",
            )
        # Token ids may sit on the wrapper only.
        fields = {
            k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in raw
        } | dict(text)
        return _parse_text(fields, model_type, prefix="text_config.")
    if model_type in TEXT_MODEL_TYPES:
        return _parse_text(raw, model_type, prefix="")
    known = TEXT_MODEL_TYPES + WRAPPER_MODEL_TYPES
    raise ConfigError.at("model_type", f"unsupported {model_type!r}, expected one of {known}")


def _parse_text(data: Mapping[str, Any], model_type: str, prefix: str) -> KimiConfig:
    r = FieldReader(data, prefix)
    heads = r.positive("num_attention_heads")
    if data.get("num_key_value_heads", heads) != heads:
        raise r.fail("num_key_value_heads", f"MLA needs it equal to num_attention_heads ({heads})")
    # transformers' DeepseekV3Config has no scoring_func / topk_method: it always routes this way.
    r.equal("scoring_func", "sigmoid", default="sigmoid")
    r.equal("topk_method", "noaux_tc", default="noaux_tc")
    r.equal("hidden_act", "silu")
    r.equal("tie_word_embeddings", False, default=False)
    r.equal("attention_bias", False, default=False)
    if data.get("q_lora_rank") is None:
        raise r.fail(
            "q_lora_rank",
            "missing (the q_proj-without-LoRA variant of DeepSeek-V2-Lite is not supported)",
        )

    rope_theta, yarn = parse_rope(data, r)
    eos = r.get("eos_token_id", object)
    eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
    cfg = KimiConfig(
        model_type=model_type,
        vocab_size=r.positive("vocab_size"),
        hidden_size=r.positive("hidden_size"),
        intermediate_size=r.positive("intermediate_size"),
        moe_intermediate_size=r.positive("moe_intermediate_size"),
        num_hidden_layers=r.positive("num_hidden_layers"),
        num_attention_heads=heads,
        q_lora_rank=r.positive("q_lora_rank"),
        kv_lora_rank=r.positive("kv_lora_rank"),
        qk_nope_head_dim=r.positive("qk_nope_head_dim"),
        qk_rope_head_dim=r.positive("qk_rope_head_dim"),
        v_head_dim=r.positive("v_head_dim"),
        n_routed_experts=r.positive("n_routed_experts"),
        n_shared_experts=r.get("n_shared_experts", int),
        num_experts_per_tok=r.positive("num_experts_per_tok"),
        n_group=r.positive("n_group"),
        topk_group=r.positive("topk_group"),
        routed_scaling_factor=r.get("routed_scaling_factor", float),
        norm_topk_prob=r.get("norm_topk_prob", bool),
        first_k_dense_replace=r.get("first_k_dense_replace", int),
        # HF DeepseekV3Config has no moe_layer_freq (it is always 1); Moonshot's file writes 1.
        moe_layer_freq=r.get("moe_layer_freq", int, 1),
        rms_norm_eps=r.get("rms_norm_eps", float),
        rope_theta=rope_theta,
        # transformers >= 4.57 names the checkpoint's interleaved
        # rope channels; Moonshot's code always interleaves.
        rope_interleave=r.get("rope_interleave", bool, True),
        yarn=yarn,
        max_position_embeddings=r.positive("max_position_embeddings"),
        bos_token_id=r.get("bos_token_id", int, None),
        eos_token_ids=eos_ids,
        pad_token_id=r.get("pad_token_id", int, None),
    )
    _check_consistency(cfg, r)
    return cfg


def _check_consistency(cfg: KimiConfig, r: FieldReader) -> None:
    def fail(key: str, msg: str) -> None:
        raise r.fail(key, msg)

    if cfg.qk_rope_head_dim % 2:
        fail(
            "qk_rope_head_dim",
            f"must be even (rope rotates channel pairs), got {cfg.qk_rope_head_dim}",
        )
    if cfg.n_routed_experts % cfg.n_group:
        fail("n_group", f"{cfg.n_group} does not divide n_routed_experts={cfg.n_routed_experts}")
    group_size = cfg.n_routed_experts // cfg.n_group
    if cfg.n_group > 1 and group_size < 2:
        fail(
            "n_group",
            f"each group needs >= 2 experts (group score = sum of its top-2), got {group_size}",
        )
    if cfg.topk_group > cfg.n_group:
        fail("topk_group", f"{cfg.topk_group} exceeds n_group={cfg.n_group}")
    if cfg.num_experts_per_tok > cfg.topk_group * group_size:
        fail(
            "num_experts_per_tok",
            f"{cfg.num_experts_per_tok} exceeds the {cfg.topk_group * group_size} experts "
            f"of topk_group groups",
        )
    if not 0 <= cfg.first_k_dense_replace <= cfg.num_hidden_layers:
        fail(
            "first_k_dense_replace",
            f"must lie in [0, num_hidden_layers], got {cfg.first_k_dense_replace}",
        )
    if cfg.moe_layer_freq < 1:
        fail("moe_layer_freq", f"must be >= 1, got {cfg.moe_layer_freq}")
    if cfg.rms_norm_eps <= 0:
        fail("rms_norm_eps", f"must be positive, got {cfg.rms_norm_eps}")
    for key in ("bos_token_id", "pad_token_id"):
        token = getattr(cfg, key)
        if token is not None and not 0 <= token < cfg.vocab_size:
            fail(key, f"{token} outside the vocabulary [0, {cfg.vocab_size})")
    for token in cfg.eos_token_ids:
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < cfg.vocab_size:
            fail("eos_token_id", f"{token!r} is not a token id in [0, {cfg.vocab_size})")
    if cfg.yarn is not None:
        # transformers replaces the YaRN factor by max_position_embeddings /
        # original_max_position_embeddings while the attention mscale keeps
        # the file's factor; a file where they disagree has no single meaning.
        implied = cfg.max_position_embeddings / cfg.yarn.original_max_position_embeddings
        if not math.isclose(implied, cfg.yarn.factor):
            fail(
                "max_position_embeddings",
                f"{cfg.max_position_embeddings} / original_max_position_embeddings "
                f"{cfg.yarn.original_max_position_embeddings} = {implied:g} disagrees with "
                f"the YaRN factor "
                f"{cfg.yarn.factor:g}",
            )
