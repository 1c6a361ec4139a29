"""Train "kimi-mini": a ~6M-parameter Kimi-architecture target
(MLA, a dense first layer, sigmoid-routed MoE with a shared expert)
on the stdlib corpus, with next-token cross-entropy and AdamW.

    python -m jaxdd.train.target OUT_DIR [--minutes 90] [--steps N] [--seed 0] [--layers 4]

Writes OUT_DIR/target (an HF-layout checkpoint: config.json + safetensors + tokenizer.json and
tokenizer_config.json, which transformers loads too) and OUT_DIR/target_history.json (train /
validation loss per evaluation).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from convert.jaxdd_to_hf import export
from jaxdd.cache import LatentCache
from jaxdd.config import KimiConfig
from jaxdd.models.target import KimiTarget
from jaxdd.runtime.backend import Backend
from jaxdd.train.data import encode_corpus, read_texts, split, stdlib_files, windows
from jaxdd.train.tokenizer import END_OF_TEXT, save_tokenizer, train_tokenizer
from jaxdd.weights.checkpoint import save_target

VOCAB = 4096
KIMI_MINI = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "intermediate_size": 768,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


def causal_loss(model: KimiTarget, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy over tokens [B, T + 1]."""
    inputs = tokens[:, :-1]
    labels = tokens[:, 1:]
    b, t = inputs.shape
    cache = LatentCache.zeros(model.config, b, t, model.dtype)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    visible = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    hidden = model(
        inputs, positions, cache, visible, attention="naive", backend=Backend.local()
    ).hidden
    return optax.softmax_cross_entropy_with_integer_labels(model.logits(hidden), labels).mean()


def make_optimizer(model: nnx.Module, steps: int, peak_lr: float = 3e-3) -> nnx.Optimizer:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, peak_lr, min(200, steps // 10 + 1), steps, peak_lr / 10
    )
    # decay matrices, not norms or biases
    mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    transform = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1, mask=mask)
    )
    return nnx.Optimizer(model, transform, wrt=nnx.Param)


@nnx.jit
def train_step(
    model: nnx.Module, optimizer: nnx.Optimizer, tokens: jax.Array, loss_fn=causal_loss
) -> jax.Array:
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def eval_loss(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    return causal_loss(model, tokens)


def train(
    out: Path,
    minutes: float = 90.0,
    steps: int = 20000,
    batch: int = 16,
    length: int = 256,
    seed: int = 0,
    layers: int = KIMI_MINI["num_hidden_layers"],
) -> dict:
    """Train within ``minutes`` (or ``steps``); returns the history (also written next
    to the checkpoint). ``layers``: decoder layers (the first dense, the rest MoE)."""
    out.mkdir(parents=True, exist_ok=True)
    train_files, validation_files = split(stdlib_files())
    tokenizer = train_tokenizer(read_texts(train_files), VOCAB)
    separator = tokenizer.token_to_id(END_OF_TEXT)
    train_tokens = encode_corpus(tokenizer, train_files, separator)
    validation_tokens = encode_corpus(tokenizer, validation_files, separator)
    validation = windows(validation_tokens, 64, length + 1, np.random.default_rng(1))

    config = KimiConfig.from_hf({**KIMI_MINI, "num_hidden_layers": layers})
    model = KimiTarget(config, jnp.float32, rngs=nnx.Rngs(seed))
    optimizer = make_optimizer(model, steps)
    rng = np.random.default_rng(seed)
    history = {"step": [], "train_loss": [], "validation_loss": [], "seconds": [], "tokens": []}
    start = time.perf_counter()
    losses = []
    for step in range(1, steps + 1):
        losses.append(
            float(train_step(model, optimizer, windows(train_tokens, batch, length + 1, rng)))
        )
        elapsed = time.perf_counter() - start
        if step % 100 == 0 or step == steps or elapsed > minutes * 60:
            val = float(np.mean([eval_loss(model, v) for v in np.split(validation, 4)]))
            for key, value in (
                ("step", step),
                ("train_loss", float(np.mean(losses))),
                ("validation_loss", val),
            ):
                history[key].append(value)
            history["seconds"].append(round(elapsed, 1))
            history["tokens"].append(step * batch * length)
            print(
                f"step {step}: train {np.mean(losses):.3f} validation {val:.3f} "
                f"({elapsed / 60:.1f} min)",
                flush=True,
            )
            losses = []
        if elapsed > minutes * 60:
            break
    # HF layout through the exporter, so transformers loads it
    with tempfile.TemporaryDirectory() as staging:
        export(save_target(model, Path(staging) / "target"), out / "target", progress=False)
    save_tokenizer(tokenizer, out / "target", config.max_position_embeddings)
    (out / "target_history.json").write_text(json.dumps(history, indent=2))
    return history


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxdd.train.target", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("--minutes", type=float, default=90.0)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=KIMI_MINI["num_hidden_layers"])
    args = parser.parse_args(argv)
    train(args.out, args.minutes, args.steps, seed=args.seed, layers=args.layers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
