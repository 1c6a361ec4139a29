"""Tiny Kimi-flavoured HF transformers ``DeepseekV3ForCausalLM``
references, built at test time (fp32, CPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

YARN_K2 = {
    "type": "yarn",
    "factor": 32.0,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
}

# K2-Instruct flavour: n_group 1, YaRN factor 32 with beta 1/1, eps 1e-6.
TINY_K2 = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.827,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    rope_theta=50000.0,
    rope_scaling=YARN_K2,
    max_position_embeddings=32 * 4096,
    rms_norm_eps=1e-6,
    norm_topk_prob=True,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)

# K2.5 flavour: YaRN factor 64 with beta_fast 32, eps
# 1e-5 (so the q_a/kv_a norms' 1e-6 differs from it).
TINY_K25 = TINY_K2 | dict(
    rope_scaling=YARN_K2 | {"factor": 64.0, "beta_fast": 32.0},
    max_position_embeddings=64 * 4096,
    rms_norm_eps=1e-5,
)

# DeepSeek-V3 flavour: group-limited routing (4 groups,
# best 2 kept), 2 dense layers, no shared-expert scaling.
TINY_DSV3 = TINY_K2 | dict(
    n_group=4,
    topk_group=2,
    first_k_dense_replace=2,
    num_hidden_layers=4,
    routed_scaling_factor=2.5,
    rope_scaling=YARN_K2 | {"factor": 40.0, "beta_fast": 32.0},
    max_position_embeddings=40 * 4096,
)

FLAVOURS = {"k2": TINY_K2, "k25": TINY_K25, "dsv3": TINY_DSV3}


def hf_model(config: dict, seed: int) -> DeepseekV3ForCausalLM:
    """A random fp32 HF model in eval mode with eager
    attention and a random non-zero router bias."""
    torch.manual_seed(seed)
    cfg = DeepseekV3Config(**config)
    cfg._attn_implementation = "eager"
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            # HF initialises the bias to zero, which would
            # leave selection-only bias handling untested.
            layer.mlp.gate.e_score_correction_bias.data = 0.1 * torch.rand_like(
                layer.mlp.gate.e_score_correction_bias
            )
    return model


def save_hf_model(model: DeepseekV3ForCausalLM, directory: Path) -> Path:
    model.save_pretrained(directory)
    return directory


def additive_mask(visible: np.ndarray) -> torch.Tensor:
    """bool [B, T, S] -> HF eager attention's additive float mask [B, 1, T, S]."""
    mask = torch.zeros(visible.shape, dtype=torch.float32)
    mask[~torch.from_numpy(np.array(visible))] = torch.finfo(torch.float32).min
    return mask[:, None]


def random_tree_parents(rng: np.random.Generator, nodes: int) -> np.ndarray:
    """parents[0] = -1 (the root), every other node's parent comes before it."""
    return np.array([-1] + [int(rng.integers(0, i)) for i in range(1, nodes)])


def tree_depths_and_mask(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(depths [N], ancestor-or-self mask [N, N]) of a parent array in topological order."""
    n = len(parents)
    depths = np.zeros(n, np.int64)
    visible = np.eye(n, dtype=bool)
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
        visible[i] |= visible[parents[i]]
    return depths, visible


def rel_err(actual, expected) -> float:
    """max |actual - expected| / max |expected|."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


# --- DFlash drafters (z-lab dflash.model.DFlashDraftModel) ----------------------------------------


def drafter_config(block_size: int = 8, yarn: bool = False, **overrides) -> dict:
    """A tiny Qwen3-style DFlash drafter for the 3-layer
    TINY_* targets (hidden 64, taps after layers 1 and 0)."""
    config = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        vocab_size=256,
        max_position_embeddings=4096,
        num_target_layers=3,
        block_size=block_size,
        dflash_config={"mask_token_id": 255, "target_layer_ids": [1, 0]},
    )
    # Kimi drafters: YaRN over the whole head_dim with mscale = mscale_all_dim (amplitude 1)
    if yarn:
        config |= dict(
            rope_theta=50000.0,
            max_position_embeddings=64 * 4096,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 64.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        )
    return config | overrides


# 8 heads and 16 experts of width 64, so that 8 devices split heads, experts (ep) and expert width
SHARDABLE_K2 = TINY_K2 | dict(
    num_attention_heads=8, num_key_value_heads=8, moe_intermediate_size=64
)
SHARDABLE_DRAFTER = drafter_config(num_attention_heads=8, num_key_value_heads=8, head_dim=8)


def hf_drafter(config: dict, seed: int):
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    torch.manual_seed(seed)
    return DFlashDraftModel(Qwen3Config(**config)).float().eval()


def hf_greedy(target, prompt, max_new_tokens: int) -> list[int]:
    """Greedy decoding by full HF forwards (no cache, no
    stop tokens): the simplest possible reference."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def save_random_pair(
    root: Path, target_config: dict, drafter_settings: dict, seed: int
) -> tuple[Path, Path]:
    """Save a random HF target and DFlash drafter under
    ``root``: (target directory, drafter directory)."""
    hf_model(target_config, seed).save_pretrained(root / "target")
    hf_drafter(drafter_settings, seed).save_pretrained(root / "drafter")
    return root / "target", root / "drafter"
