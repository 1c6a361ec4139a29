"""Train a DFlash drafter for a frozen target with the DFlash recipe.

    python -m jaxdd.train.drafter TARGET_DIR OUT_DIR [--minutes 90] [--steps N] [--seed 0]

Per step: windows of the corpus go through the frozen target once, which returns its tapped hidden states; random
anchor positions a are drawn in every window; each block is [x_a, MASK x (B-1)] at positions a .. a+B-1, sees
the target features of the tokens before a (KV injection, exactly as at inference) and itself bidirectionally,
and mask slot i is trained to predict x_{a+i} with cross-entropy weighted by exp(-(i-1)/gamma), gamma = 7 for
B = 16 scaled to the block size (later positions matter less: a draft is only useful while all before it are
right). Writes OUT_DIR (z-lab DFlash layout: config.json with dflash_config + safetensors) and the history.
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
from tokenizers import Tokenizer

import jaxdd
from convert.jaxdd_to_hf import export
from jaxdd.cache import LatentCache
from jaxdd.checkpoint import save_drafter
from jaxdd.config import DrafterConfig
from jaxdd.drafter import DFlashDrafter, DraftCache
from jaxdd.target import KimiTarget
from jaxdd.train.data import encode_corpus, split, stdlib_files, windows
from jaxdd.train.target import make_optimizer
from jaxdd.train.tokenizer import END_OF_TEXT, MASK


def drafter_hf_config(target_config, block_size: int = 8, layers: int = 2, mask_token_id: int = 1) -> dict:
    """A Qwen3-style DFlash drafter config sized for ``target_config`` (what ``DFlashDraftModel`` loads)."""
    hidden = target_config.hidden_size
    depth = target_config.num_hidden_layers
    taps = sorted({depth // 3, min(2 * depth // 3, depth - 1)})  # an early and a middle layer, as DFlash taps
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "num_target_layers": target_config.num_hidden_layers,
        "vocab_size": target_config.vocab_size,
        "max_position_embeddings": target_config.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": taps},
    }


def position_weights(block_size: int) -> jax.Array:
    """exp(-(i - 1) / gamma) for mask slots i = 1 .. B-1, gamma = 7 at B = 16."""
    gamma = 7.0 * block_size / 16
    return jnp.exp(-jnp.arange(block_size - 1) / gamma)


def block_logits(drafter: DFlashDrafter, target: KimiTarget, tokens, features, anchors):
    """(draft logits [N*A, B-1, V], labels [N*A, B-1]) for the blocks anchored at ``anchors`` [N, A] in
    tokens [N, T], each seeing the frozen target's features [N, T, K*D] of the tokens before its anchor."""
    n, t = tokens.shape
    block = drafter.config.block_size
    rows = n * anchors.shape[1]
    sequence = jnp.repeat(jnp.arange(n), anchors.shape[1])
    anchor = anchors.reshape(-1)
    # One draft cache row per block, filled by the same KV injection as at inference.
    cache = DraftCache.zeros(drafter.config, rows, t, drafter.dtype)
    positions = jnp.broadcast_to(jnp.arange(t), (rows, t))
    cache = drafter.inject(cache, features[sequence], positions, anchor)
    full = jnp.full((rows,), block, jnp.int32)
    logits = drafter.draft_logits(target, cache, tokens[sequence, anchor], anchor, full, block)
    labels = tokens[sequence[:, None], anchor[:, None] + jnp.arange(1, block)[None, :]]
    return logits, labels


def dflash_loss(drafter: DFlashDrafter, target: KimiTarget, tokens, features, anchors) -> jax.Array:
    """Block cross-entropy weighted by position (``position_weights``)."""
    logits, labels = block_logits(drafter, target, tokens, features, anchors)
    weights = position_weights(drafter.config.block_size)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return (loss * weights).sum() / (labels.shape[0] * weights.sum())


@nnx.jit(static_argnames="taps")
def target_features(target: KimiTarget, tokens: jax.Array, taps: tuple[int, ...]) -> jax.Array:
    """The frozen target's tapped residual streams [N, T, len(taps) * D]."""
    b, t = tokens.shape
    cache = LatentCache.zeros(target.config, b, t, target.dtype)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    visible = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    return target(tokens, positions, cache, visible, taps=taps, form="naive").taps


@nnx.jit
def drafter_step(drafter, optimizer, target, tokens, features, anchors) -> jax.Array:
    loss, grads = nnx.value_and_grad(dflash_loss)(drafter, target, tokens, features, anchors)
    optimizer.update(drafter, grads)
    return loss


@nnx.jit
def drafter_eval(drafter, target, tokens, features, anchors) -> tuple[jax.Array, jax.Array]:
    """(loss, accuracy of the greedy draft per mask slot [B-1])."""
    logits, labels = block_logits(drafter, target, tokens, features, anchors)
    return dflash_loss(drafter, target, tokens, features, anchors), (jnp.argmax(logits, -1) == labels).mean(0)


def random_anchors(rng: np.random.Generator, n: int, per_sequence: int, length: int, block: int) -> np.ndarray:
    """[n, per_sequence] anchor positions with at least one context token before and a whole block after."""
    return rng.integers(1, length - block + 1, (n, per_sequence)).astype(np.int32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxdd.train.drafter", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", type=Path, help="HF-layout target directory with tokenizer.json")
    parser.add_argument("out", type=Path)
    parser.add_argument("--minutes", type=float, default=90.0)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train(args.target, args.out, args.minutes, args.steps, seed=args.seed)
    return 0


def train(
    target_dir: Path,
    out: Path,
    minutes: float,
    steps: int,
    batch: int = 8,
    length: int = 256,
    anchors: int = 8,
    seed: int = 0,
) -> dict:
    target = jaxdd.load_target(target_dir, dtype="float32").model
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    hf_config = drafter_hf_config(target.config, mask_token_id=tokenizer.token_to_id(MASK))
    config = DrafterConfig.from_hf(hf_config)
    drafter = DFlashDrafter(config, jnp.float32, rngs=nnx.Rngs(seed))
    optimizer = make_optimizer(drafter, steps)
    train_files, validation_files = split(stdlib_files())
    separator = tokenizer.token_to_id(END_OF_TEXT)
    train_tokens = encode_corpus(tokenizer, train_files, separator)
    validation = windows(encode_corpus(tokenizer, validation_files, separator), 16, length, np.random.default_rng(1))
    validation_anchors = random_anchors(np.random.default_rng(2), 16, anchors, length, config.block_size)
    validation_features = target_features(target, jnp.asarray(validation), config.target_layer_ids)
    rng = np.random.default_rng(seed)
    history = {"step": [], "train_loss": [], "validation_loss": [], "accuracy": [], "seconds": []}
    start, losses = time.perf_counter(), []
    for step in range(1, steps + 1):
        tokens = jnp.asarray(windows(train_tokens, batch, length, rng))
        features = target_features(target, tokens, config.target_layer_ids)
        chosen = jnp.asarray(random_anchors(rng, batch, anchors, length, config.block_size))
        losses.append(float(drafter_step(drafter, optimizer, target, tokens, features, chosen)))
        elapsed = time.perf_counter() - start
        if step % 100 == 0 or step == steps or elapsed > minutes * 60:
            val, accuracy = drafter_eval(
                drafter, target, jnp.asarray(validation), validation_features, validation_anchors
            )
            history["step"].append(step)
            history["train_loss"].append(float(np.mean(losses)))
            history["validation_loss"].append(float(val))
            history["accuracy"].append([round(float(a), 4) for a in accuracy])
            history["seconds"].append(round(elapsed, 1))
            print(
                f"step {step}: train {np.mean(losses):.3f} validation {float(val):.3f} "
                f"accuracy {np.round(np.asarray(accuracy), 3).tolist()} ({elapsed / 60:.1f} min)",
                flush=True,
            )
            losses = []
        if elapsed > minutes * 60:
            break
    with tempfile.TemporaryDirectory() as staging:
        export(save_drafter(drafter, Path(staging) / "drafter", hf_config), out, progress=False)
    (out.parent / f"{out.name}_history.json").write_text(json.dumps(history, indent=2))
    return history


if __name__ == "__main__":
    raise SystemExit(main())
