"""Train a DFlash drafter for a frozen target with the DFlash recipe.

    python -m jaxdd.train.drafter TARGET_DIR OUT_DIR [--minutes 90] [--steps N] [--seed 0]
                                  [--sequences 2048] [--max-context 64] [--layers 2]
                                  [--init DRAFTER_DIR] [--peak-lr 3e-3]

Data (``jaxdd.train.continuations``): the target's own greedy continuations (192 tokens) of
--sequences corpus windows of 64 to --max-context tokens; anchors lie in the generated part.
The frozen target's tapped hidden states of every sequence are computed once, before
training, and kept on disk in bf16 (OUT_DIR_features; a step reads its rows). Per step: a
batch of sequences of one padded length is drawn; random anchor positions a are drawn in every
sequence; each block is [x_a, MASK x (B-1)] at positions a .. a+B-1, sees the target features
of the tokens before a (KV injection, exactly as at inference) and itself bidirectionally
(all blocks of a sequence in one row over its one cache: ``jaxdd.train.blocks``), and mask
slot i is trained to predict x_{a+i} with cross-entropy weighted by exp(-(i-1)/gamma), gamma
= 7 for B = 16 scaled to the block size (later positions matter less: a draft is only useful
while all before it are right). Writes OUT_DIR (z-lab DFlash layout: config.json with
dflash_config + safetensors) and the history; saves itself every few minutes
(OUT_DIR_checkpoints, with the data in OUT_DIR_data.npz and OUT_DIR_features) and resumes from
there when started again.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from jaxdd import cli
from jaxdd.config import DrafterConfig
from jaxdd.models.drafter import DFlashDrafter
from jaxdd.models.target import KimiTarget
from jaxdd.train.blocks import block_logits
from jaxdd.train.continuations import MIN_CONTEXT, TrainingData
from jaxdd.train.resume import (
    TrainingCheckpoints,
    refuse_finished,
    step_rng,
    write_history,
)
from jaxdd.train.target import make_optimizer
from jaxdd.train.tokenizer import MASK
from jaxdd.weights.checkpoint import save_drafter


def drafter_hf_config(
    target_config, block_size: int = 8, layers: int = 2, mask_token_id: int = 1
) -> dict:
    """A Qwen3-style DFlash drafter config sized for
    ``target_config`` (what ``DFlashDraftModel`` loads)."""
    hidden = target_config.hidden_size
    depth = target_config.num_hidden_layers
    # an early and a middle layer, as DFlash taps
    taps = sorted({depth // 3, min(2 * depth // 3, depth - 1)})
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


def weighted_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Block cross-entropy of logits [N, B-1, V] weighted by position (``position_weights``)."""
    weights = position_weights(labels.shape[1] + 1)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return (loss * weights).sum() / (labels.shape[0] * weights.sum())


def dflash_loss(drafter: DFlashDrafter, target: KimiTarget, tokens, features, anchors) -> jax.Array:
    """The position-weighted block cross-entropy of the blocks at ``anchors``."""
    return weighted_loss(*block_logits(drafter, target, tokens, features, anchors))


@nnx.jit
def drafter_step(drafter, optimizer, target, tokens, features, anchors) -> jax.Array:
    loss, grads = nnx.value_and_grad(dflash_loss)(drafter, target, tokens, features, anchors)
    optimizer.update(drafter, grads)
    return loss


@nnx.jit
def drafter_eval(drafter, target, tokens, features, anchors) -> tuple[jax.Array, jax.Array]:
    """(loss, accuracy of the greedy draft per mask slot [B-1])."""
    logits, labels = block_logits(drafter, target, tokens, features, anchors)
    return weighted_loss(logits, labels), (jnp.argmax(logits, -1) == labels).mean(0)


def random_anchors(
    rng: np.random.Generator,
    n: int,
    per_sequence: int,
    length: int | np.ndarray,
    block: int,
    first: int | np.ndarray = 1,
) -> np.ndarray:
    """[n, per_sequence] anchor positions from ``first`` (>= 1: some context before) with a
    whole block before ``length``; ``first`` and ``length`` may differ per sequence ([n])."""
    low, high = (np.asarray(x).reshape(-1, 1) for x in (first, np.asarray(length) - block + 1))
    return rng.integers(low, high, (n, per_sequence)).astype(np.int32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxdd.train.drafter", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("target", type=Path, help="HF-layout target directory with tokenizer.json")
    parser.add_argument("out", type=Path)
    parser.add_argument("--minutes", type=float, default=90.0)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sequences", type=int, default=2048, help="greedy target continuations to train on"
    )
    parser.add_argument(
        "--layers", type=int, default=2, help="drafter layers (its cost per round grows with them)"
    )
    parser.add_argument(
        "--max-context",
        type=int,
        default=64,
        help="corpus tokens before a continuation: 64 up to this many (uniform)",
    )
    parser.add_argument("--init", type=Path, help="a z-lab-layout drafter to continue")
    parser.add_argument("--peak-lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    cli.choose_platform(cpu_only=True)
    refuse_finished(args.out)
    options = DrafterTraining(
        args.minutes,
        args.steps,
        seed=args.seed,
        sequences=args.sequences,
        layers=args.layers,
        max_context=args.max_context,
        init=args.init,
        peak_lr=args.peak_lr,
    )
    train(args.target, args.out, options)
    return 0


def initial_drafter(
    target: KimiTarget, tokenizer: Tokenizer, layers: int, seed: int, init: Path | None
) -> tuple[DFlashDrafter, dict]:
    """(drafter, its z-lab config): ``init``'s, or a new one of ``layers`` for ``target``."""
    if init is not None:
        return jaxdd.load_drafter(init, dtype="float32"), json.loads(
            (init / "config.json").read_text()
        )
    hf_config = drafter_hf_config(
        target.config, layers=layers, mask_token_id=tokenizer.token_to_id(MASK)
    )
    return DFlashDrafter(DrafterConfig.from_hf(hf_config), jnp.float32, rngs=nnx.Rngs(seed)), (
        hf_config
    )


def evaluate(
    drafter: DFlashDrafter, target: KimiTarget, buckets: dict, anchors: dict
) -> tuple[float, dict[str, float], list[float]]:
    """(validation loss, loss by padded length, greedy accuracy per mask slot) over ``buckets``
    ({length: Bucket}) at their ``anchors``, weighted by the sequences of each length."""
    results = {
        size: drafter_eval(
            drafter,
            target,
            jnp.asarray(b.tokens),
            jnp.asarray(b.features.read(range(len(b.contexts))), jnp.float32),
            anchors[size],
        )
        for size, b in buckets.items()
    }
    count = {size: len(b.contexts) for size, b in buckets.items()}
    total = sum(count.values())
    loss = sum(float(val) * count[size] for size, (val, _) in results.items()) / total
    accuracy = sum(np.asarray(a) * count[size] for size, (_, a) in results.items()) / total
    by_length = {str(size): round(float(val), 4) for size, (val, _) in results.items()}
    return loss, by_length, [round(float(a), 4) for a in accuracy]


def fixed_anchors(buckets: dict, per_sequence: int, generated: int, block: int) -> dict:
    """{length: anchors} for validation: the same random ones at every evaluation."""
    rng = np.random.default_rng(2)
    out = {}
    for size, b in buckets.items():
        ends = b.contexts + generated
        out[size] = jnp.asarray(
            random_anchors(rng, len(b.contexts), per_sequence, ends, block, b.contexts)
        )
    return out


def new_history(data: str, init: Path | None) -> dict:
    keys = ("step", "train_loss", "validation_loss", "validation_by_length", "accuracy", "seconds")
    return {**{key: [] for key in keys}, "data": data, "init": None if init is None else str(init)}


def draw_batch(
    buckets: dict,
    rng: np.random.Generator,
    batch: int,
    per_sequence: int,
    generated: int,
    block: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A step's (tokens, features, anchors): ``batch`` sequences of one padded length (a length
    drawn as often as it has sequences), ``per_sequence`` anchors in each one's generated part."""
    sizes = sorted(buckets)
    weights = np.array([len(buckets[size].contexts) for size in sizes], float)
    bucket = buckets[sizes[rng.choice(len(sizes), p=weights / weights.sum())]]
    rows = rng.integers(0, len(bucket.contexts), batch)
    first = bucket.contexts[rows]
    chosen = random_anchors(rng, batch, per_sequence, first + generated, block, first)
    features = jnp.asarray(bucket.features.read(rows), jnp.float32)
    return jnp.asarray(bucket.tokens[rows]), features, jnp.asarray(chosen)


@dataclasses.dataclass(frozen=True)
class DrafterTraining:
    """A drafter's training run: within ``minutes`` (data generation included) or ``steps`` of
    ``batch`` sequences with ``anchors`` blocks each, on ``sequences`` greedy continuations of
    ``generated`` tokens after 64 to ``max_context`` corpus tokens; a new drafter of ``layers``
    or ``init``'s (a z-lab-layout drafter to start from)."""

    minutes: float
    steps: int
    batch: int = 8
    generated: int = 192
    anchors: int = 8
    seed: int = 0
    sequences: int = 2048
    layers: int = 2
    max_context: int = MIN_CONTEXT
    init: Path | None = None
    peak_lr: float = 3e-3


def train(target_dir: Path, out: Path, options: DrafterTraining) -> dict:
    """Train a drafter for the target in ``target_dir`` as ``options`` say; returns the history
    (also written next to ``out``)."""
    started = time.perf_counter()
    loaded = jaxdd.load_target(target_dir, dtype="float32")
    target = loaded.model
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    drafter, hf_config = initial_drafter(
        target, tokenizer, options.layers, options.seed, options.init
    )
    config = drafter.config
    optimizer = make_optimizer(drafter, options.steps, options.peak_lr)
    checkpoints = TrainingCheckpoints(out.parent / f"{out.name}_checkpoints")
    done, history = checkpoints.restore(drafter, optimizer)
    data = TrainingData.load_or_make(
        out.parent / f"{out.name}_data.npz",
        loaded,
        tokenizer,
        sequences=options.sequences,
        max_context=options.max_context,
        generated=options.generated,
        seed=options.seed,
    )
    feature_dir = out.parent / f"{out.name}_features"
    train_set = data.buckets(target, config.target_layer_ids, "train", feature_dir)
    validation_set = data.buckets(target, config.target_layer_ids, "validation", feature_dir)
    print(f"data and target features in {(time.perf_counter() - started) / 60:.1f} min", flush=True)
    validation_anchors = fixed_anchors(
        validation_set, options.anchors, options.generated, config.block_size
    )
    history = history or new_history(
        f"greedy continuations of {options.generated} tokens after {options.sequences} corpus "
        f"windows of {MIN_CONTEXT}-{options.max_context} tokens",
        options.init,
    )
    # the time limit counts the runs this one resumes (and generating the data)
    start = started - (history["seconds"][-1] if history["seconds"] else 0.0)
    losses = []
    for step in range(done + 1, options.steps + 1):
        rng = step_rng(options.seed, step)
        drawn = draw_batch(
            train_set, rng, options.batch, options.anchors, options.generated, config.block_size
        )
        losses.append(float(drafter_step(drafter, optimizer, target, *drawn)))
        elapsed = time.perf_counter() - start
        last = step == options.steps or elapsed > options.minutes * 60
        if step % 100 == 0 or last:
            val, by_length, accuracy = evaluate(drafter, target, validation_set, validation_anchors)
            history["step"].append(step)
            history["train_loss"].append(float(np.mean(losses)))
            history["validation_loss"].append(val)
            history["validation_by_length"].append(by_length)
            history["accuracy"].append(accuracy)
            history["seconds"].append(round(elapsed, 1))
            print(
                f"step {step}: train {np.mean(losses):.3f} validation {val:.3f} "
                f"{history['validation_by_length'][-1]} accuracy {accuracy} "
                f"({elapsed / 60:.1f} min)",
                flush=True,
            )
            losses = []
            checkpoints.maybe_save(step, drafter, optimizer, history, force=last)
        if last:
            break
    with tempfile.TemporaryDirectory() as staging:
        export(save_drafter(drafter, Path(staging) / "drafter", hf_config), out, progress=False)
    write_history(out.parent / f"{out.name}_history.json", history)
    return history


if __name__ == "__main__":
    cli.run(main)
