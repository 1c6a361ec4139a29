"""Train "kimi-mini": a ~6M-parameter Kimi-architecture target
(MLA, a dense first layer, sigmoid-routed MoE with a shared expert)
on the stdlib corpus, with next-token cross-entropy and AdamW.

    python -m jaxdd.train.target OUT_DIR [--minutes 90] [--steps N] [--seed 0] [--layers 4]
                                 [--length 256] [--batch 16] [--init HF_DIR] [--peak-lr 3e-3]

Writes OUT_DIR/target (an HF-layout checkpoint: config.json + safetensors + tokenizer.json and
tokenizer_config.json, which transformers loads too) and OUT_DIR/target_history.json (train /
validation loss per evaluation, and validation loss by position bucket).

A length curriculum is two runs: windows of 256 tokens from scratch, then ``--init`` that
target (its weights and tokenizer) on long windows. A run saves itself under
OUT_DIR/checkpoints every few minutes and resumes from there when started again.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tokenizers import Tokenizer

from convert.jaxdd_to_hf import export
from jaxdd import cli
from jaxdd.api import load_target
from jaxdd.cache import LatentCache
from jaxdd.config import KimiConfig
from jaxdd.models.target import KimiTarget
from jaxdd.runtime.backend import Backend
from jaxdd.train.data import encode_corpus, read_texts, split, stdlib_files, windows
from jaxdd.train.resume import (
    TrainingCheckpoints,
    refuse_finished,
    step_rng,
    write_history,
)
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


def causal_forward(model: KimiTarget, tokens: jax.Array, taps: tuple[int, ...] = ()):
    """The target over whole sequences tokens [B, T] from position 0 (a fresh cache, causal
    attention): its forward's result, with the ``taps`` layers' residual streams."""
    b, t = tokens.shape
    cache = LatentCache.zeros(model.config, b, t, model.dtype)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    visible = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    return model(
        tokens, positions, cache, visible, taps=taps, attention="naive", backend=Backend.local()
    )


def position_losses(model: KimiTarget, tokens: jax.Array) -> jax.Array:
    """Next-token cross-entropy [B, T] of tokens [B, T + 1]."""
    hidden = causal_forward(model, tokens[:, :-1]).hidden
    return optax.softmax_cross_entropy_with_integer_labels(model.logits(hidden), tokens[:, 1:])


def causal_loss(model: KimiTarget, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy over tokens [B, T + 1]."""
    return position_losses(model, tokens).mean()


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


@nnx.jit
def eval_position_losses(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    """Mean cross-entropy per position [T] over the batch."""
    return position_losses(model, tokens).mean(0)


def position_buckets(length: int) -> list[tuple[int, int]]:
    """[first, last] position ranges: 0-127, 128-255, then doubling up to ``length``."""
    edges = [0, min(128, length)]
    while edges[-1] < length:
        edges.append(min(2 * edges[-1], length))
    return [(a, b - 1) for a, b in itertools.pairwise(edges)]


def bucket_losses(per_position: np.ndarray) -> dict[str, float]:
    """{"first-last": mean loss} over ``position_buckets``."""
    return {
        f"{a}-{b}": round(float(per_position[a : b + 1].mean()), 4)
        for a, b in position_buckets(len(per_position))
    }


@dataclasses.dataclass(frozen=True)
class TargetTraining:
    """A target's training run: within ``minutes`` or ``steps`` of ``batch`` windows of
    ``length`` tokens; ``layers``: decoder layers (the first dense, the rest MoE); ``init``: an
    HF-layout target to start from (its tokenizer too) instead of random weights."""

    minutes: float = 90.0
    steps: int = 20000
    batch: int = 16
    length: int = 256
    seed: int = 0
    layers: int = KIMI_MINI["num_hidden_layers"]
    init: Path | None = None
    peak_lr: float = 3e-3


def train(out: Path, options: TargetTraining) -> dict:
    """Train a target as ``options`` say; returns the history (also written next to the
    checkpoint in ``out``)."""
    out.mkdir(parents=True, exist_ok=True)
    train_files, validation_files = split(stdlib_files())
    if options.init is None:
        tokenizer = train_tokenizer(read_texts(train_files), VOCAB)
        config = KimiConfig.from_hf({**KIMI_MINI, "num_hidden_layers": options.layers})
        model = KimiTarget(config, jnp.float32, rngs=nnx.Rngs(options.seed))
    else:
        tokenizer = Tokenizer.from_file(str(options.init / "tokenizer.json"))
        model = load_target(options.init, dtype="float32").model
        config = model.config
    separator = tokenizer.token_to_id(END_OF_TEXT)
    train_tokens = encode_corpus(tokenizer, train_files, separator)
    validation_tokens = encode_corpus(tokenizer, validation_files, separator)
    # the same validation tokens (64 x 256, or fewer longer windows) at any length
    validation = windows(
        validation_tokens,
        max(4, 64 * 256 // options.length),
        options.length + 1,
        np.random.default_rng(1),
    )
    optimizer = make_optimizer(model, options.steps, options.peak_lr)
    checkpoints = TrainingCheckpoints(out / "checkpoints")
    done, history = checkpoints.restore(model, optimizer)
    history = history or {
        "step": [],
        "train_loss": [],
        "validation_loss": [],
        "validation_by_position": [],
        "seconds": [],
        "tokens": [],
        "init": None if options.init is None else str(options.init),
    }
    # the time limit counts the time of the runs this one resumes
    start = time.perf_counter() - (history["seconds"][-1] if history["seconds"] else 0.0)
    losses = []
    for step in range(done + 1, options.steps + 1):
        tokens = windows(
            train_tokens, options.batch, options.length + 1, step_rng(options.seed, step)
        )
        losses.append(float(train_step(model, optimizer, tokens)))
        elapsed = time.perf_counter() - start
        last = step == options.steps or elapsed > options.minutes * 60
        if step % 100 == 0 or last:
            per_position = np.mean(
                [eval_position_losses(model, v) for v in np.split(validation, 4)], axis=0
            )
            history["step"].append(step)
            history["train_loss"].append(float(np.mean(losses)))
            history["validation_loss"].append(float(per_position.mean()))
            history["validation_by_position"].append(bucket_losses(per_position))
            history["seconds"].append(round(elapsed, 1))
            history["tokens"].append(step * options.batch * options.length)
            print(
                f"step {step}: train {np.mean(losses):.3f} validation {per_position.mean():.3f} "
                f"{history['validation_by_position'][-1]} ({elapsed / 60:.1f} min)",
                flush=True,
            )
            losses = []
            checkpoints.maybe_save(step, model, optimizer, history, force=last)
        if last:
            break
    # HF layout through the exporter, so transformers loads it
    with tempfile.TemporaryDirectory() as staging:
        export(save_target(model, Path(staging) / "target"), out / "target", progress=False)
    save_tokenizer(tokenizer, out / "target", config.max_position_embeddings)
    write_history(out / "target_history.json", history)
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
    parser.add_argument("--length", type=int, default=256, help="tokens per training window")
    parser.add_argument("--batch", type=int, default=16, help="windows per step")
    parser.add_argument(
        "--init", type=Path, help="an HF-layout target to continue (weights and tokenizer)"
    )
    parser.add_argument("--peak-lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    cli.choose_platform(cpu_only=True)
    refuse_finished(args.out / "target")
    options = TargetTraining(
        args.minutes,
        args.steps,
        batch=args.batch,
        length=args.length,
        seed=args.seed,
        layers=args.layers,
        init=args.init,
        peak_lr=args.peak_lr,
    )
    train(args.out, options)
    return 0


if __name__ == "__main__":
    cli.run(main)
