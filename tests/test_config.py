"""KimiConfig: real Kimi configs, HF-written configs, and clear errors for bad ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import DeepseekV3Config

from jaxdd.config import KimiConfig
from jaxdd.errors import ConfigError
from jaxdd.testing.reference import FLAVOURS, TINY_K2

FIXTURES = Path(__file__).parent / "fixtures"


def load_fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def test_kimi_k2_instruct():
    cfg = KimiConfig.from_json_file(FIXTURES / "kimi_k2_instruct_config.json")
    assert cfg.model_type == "kimi_k2"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (7168, 61, 64)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group) == (
        384,
        8,
        1,
        1,
    )
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.v_head_dim) == (
        1536,
        512,
        192,
        128,
    )
    assert (
        cfg.rope_theta == 50000.0
        and cfg.rms_norm_eps == 1e-6
        and cfg.routed_scaling_factor == 2.827
    )
    assert (cfg.yarn.factor, cfg.yarn.beta_fast, cfg.yarn.beta_slow) == (32.0, 1.0, 1.0)
    assert cfg.first_k_dense_replace == 1 and not cfg.is_moe_layer(0) and cfg.is_moe_layer(60)
    assert (cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_ids) == (163840, 163584, (163585,))
    assert cfg.softmax_scale == pytest.approx(0.13086080, rel=1e-7)  # research/kimi_arch.md §1.3


def test_kimi_k25_nested_text_config():
    cfg = KimiConfig.from_json_file(FIXTURES / "kimi_k25_config.json")
    assert cfg.model_type == "kimi_k25"
    assert (cfg.yarn.factor, cfg.yarn.beta_fast, cfg.rms_norm_eps) == (64.0, 32.0, 1e-5)
    assert cfg.latent_norm_eps == 1e-6  # q_a/kv_a norms keep HF's default eps
    assert (cfg.max_position_embeddings, cfg.pad_token_id, cfg.eos_token_ids) == (
        262144,
        163839,
        (163585,),
    )
    assert cfg.softmax_scale == pytest.approx(0.14467963, rel=1e-7)


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_hf_written_config_round_trips(flavour, tmp_path):
    """What transformers writes (v5 rope_parameters, no
    scoring_func) parses, and to_hf() rebuilds it."""
    DeepseekV3Config(**FLAVOURS[flavour]).save_pretrained(tmp_path)
    cfg = KimiConfig.from_json_file(tmp_path / "config.json")
    again = DeepseekV3Config(**cfg.to_hf())
    again.save_pretrained(tmp_path / "again")
    assert KimiConfig.from_json_file(tmp_path / "again" / "config.json") == cfg


def broken(**changes) -> dict:
    config = dict(
        TINY_K2,
        model_type="deepseek_v3",
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        hidden_act="silu",
    )
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    return config


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (broken(model_type="llama"), "model_type: unsupported 'llama'"),
        (broken(vocab_size=None), "vocab_size: missing"),
        (broken(hidden_size="7168"), "hidden_size: expected int"),
        (broken(kv_lora_rank=0), "kv_lora_rank: must be positive"),
        (broken(num_key_value_heads=2), "num_key_value_heads: MLA needs it equal"),
        (broken(scoring_func="softmax"), "scoring_func: only 'sigmoid'"),
        (broken(q_lora_rank=None), "q_lora_rank: missing"),
        (broken(qk_rope_head_dim=7), "qk_rope_head_dim: must be even"),
        (broken(n_group=3), "n_group: 3 does not divide n_routed_experts=16"),
        (broken(n_group=4, topk_group=5), "topk_group: 5 exceeds n_group=4"),
        (broken(n_group=4, topk_group=1, num_experts_per_tok=5), "num_experts_per_tok: 5 exceeds"),
        (broken(first_k_dense_replace=9), "first_k_dense_replace: must lie in"),
        (broken(eos_token_id=256), "eos_token_id: 256 is not a token id"),
        (
            broken(max_position_embeddings=4096),
            "max_position_embeddings: 4096 / original_max_position_embeddings",
        ),
        (broken(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling.type: only 'yarn'"),
        (
            broken(rope_scaling=TINY_K2["rope_scaling"] | {"beta_fast": None}),
            "rope_scaling.beta_fast: missing",
        ),
        (broken(rope_theta=None), "rope_theta: missing"),
        ({"model_type": "kimi_k25"}, "text_config: missing"),
        (
            {"model_type": "kimi_k25", "text_config": broken(rms_norm_eps=None)},
            "text_config.rms_norm_eps: missing",
        ),
    ],
)
def test_bad_config_names_the_field(config, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        KimiConfig.from_hf(config)


def test_unreadable_file(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        KimiConfig.from_json_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        KimiConfig.from_json_file(tmp_path / "config.json")
