"""The training pieces for the demo pair (a few steps only;
the real runs are ``python -m jaxdd.train.target``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoTokenizer, DeepseekV3ForCausalLM

import jaxdd
from convert.jaxdd_to_hf import export
from jaxdd.config import KimiConfig
from jaxdd.models.target import KimiTarget
from jaxdd.train.data import split, stdlib_files, windows
from jaxdd.train.target import KIMI_MINI, eval_loss, make_optimizer, train_step
from jaxdd.train.tokenizer import END_OF_TEXT, MASK, save_tokenizer, train_tokenizer
from jaxdd.weights.tokenizer import load_tokenizer

SMALL = KIMI_MINI | dict(num_hidden_layers=2, vocab_size=512, hidden_size=64, intermediate_size=128)


def test_corpus_split_is_fixed_and_disjoint():
    files = stdlib_files()
    train, validation = split(files)
    assert (
        len(files) > 300
        and set(train).isdisjoint(validation)
        and sorted(train + validation) == files
    )
    assert 0.02 < len(validation) / len(files) < 0.08
    assert split(stdlib_files()) == (train, validation)
    assert not any("test" in f.split("/")[:-1] for f in files)


def test_tokenizer_round_trips_and_has_the_special_tokens():
    texts = ["def f(x):\n    return x + 1\n", "class A:\n    pass\n"] * 20
    tokenizer = train_tokenizer(texts, vocab_size=300)
    assert tokenizer.token_to_id(END_OF_TEXT) == 0 and tokenizer.token_to_id(MASK) == 1
    text = "def g(y):\n    return 'é' * y  # any text encodes (byte level)\n"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_saved_tokenizer_loads_with_bos_eos_and_chat_in_transformers_and_jaxdd(tmp_path):
    tokenizer = train_tokenizer(["def f(x):\n    return x\n"] * 10, vocab_size=300)
    save_tokenizer(tokenizer, tmp_path, max_length=128)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert hf.eos_token == hf.bos_token == END_OF_TEXT and hf.model_max_length == 128
    messages = [{"role": "user", "content": "hi"}]
    ids = hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    ours = load_tokenizer(tmp_path)
    assert ours.chat_prompt("hi") == ids and ours.stop_ids == [0]


@pytest.mark.slow
def test_training_steps_lower_the_loss_and_export_loads_in_transformers(tmp_path):
    config = KimiConfig.from_hf(SMALL)
    model = KimiTarget(config, jnp.float32, rngs=nnx.Rngs(0))
    optimizer = make_optimizer(model, steps=30, peak_lr=3e-3)
    batch = jnp.asarray(np.random.default_rng(0).integers(2, 512, (4, 33)), jnp.int32)
    before = float(eval_loss(model, batch))
    for _ in range(30):
        train_step(model, optimizer, batch)
    after = float(eval_loss(model, batch))
    assert after < before - 1.0  # the batch is being memorised
    # selection bias is not trained by SGD
    assert float(jnp.abs(model.layers[1].mlp.router.bias[...]).max()) == 0.0

    hf_dir = export(jaxdd.save_target(model, tmp_path / "ckpt"), tmp_path / "hf", progress=False)
    reference = DeepseekV3ForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        expected = reference(torch.from_numpy(np.array(batch[:1, :16]))).logits.numpy()
    ours = jaxdd.load_target(hf_dir, dtype="float32").logits(np.asarray(batch[:1, :16]))
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_drafter_training_steps_and_export_loads_in_dflash(tmp_path):
    from dflash.model import DFlashDraftModel

    from jaxdd.config import DrafterConfig
    from jaxdd.models.drafter import DFlashDrafter
    from jaxdd.train.continuations import greedy_continuations, target_features
    from jaxdd.train.drafter import (
        drafter_eval,
        drafter_hf_config,
        drafter_step,
        position_weights,
        random_anchors,
    )

    target = KimiTarget(KimiConfig.from_hf(SMALL), jnp.float32, rngs=nnx.Rngs(0))
    hf_config = drafter_hf_config(target.config, block_size=4, layers=1)
    config = DrafterConfig.from_hf(hf_config)
    drafter = DFlashDrafter(config, jnp.float32, rngs=nnx.Rngs(1))
    optimizer = make_optimizer(drafter, steps=30, peak_lr=3e-3)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(2, 512, (2, 24)), jnp.int32)
    features = target_features(target, tokens, config.target_layer_ids)
    anchors = jnp.asarray(random_anchors(rng, 2, 4, 24, config.block_size, first=8))
    assert int(anchors.min()) >= 8 and int(anchors.max()) <= 24 - config.block_size
    before, accuracy = drafter_eval(drafter, target, tokens, features, anchors)
    assert accuracy.shape == (config.block_size - 1,)
    for _ in range(30):
        drafter_step(drafter, optimizer, target, tokens, features, anchors)
    after, _ = drafter_eval(drafter, target, tokens, features, anchors)
    assert float(after) < float(before) - 1.0
    weights = np.asarray(position_weights(16))
    assert (
        weights[0] == 1.0 and np.isclose(weights[7], np.exp(-1.0)) and np.all(np.diff(weights) < 0)
    )

    # The training text: the target's greedy continuation
    # of each prompt, as plain greedy decoding gives it.
    prompts = rng.integers(2, 512, (2, 5)).astype(np.int32)
    sequences = greedy_continuations(jaxdd.Target(target), prompts, 3)
    assert sequences.shape == (2, 8) and (sequences[:, :5] == prompts).all()
    for prompt, sequence in zip(prompts, sequences, strict=True):
        greedy = (
            jaxdd.Target(target)
            .generate(prompt.tolist(), max_new_tokens=3, stop_token_ids=[])
            .tokens
        )
        assert sequence[5:].tolist() == greedy

    path = export(
        jaxdd.save_drafter(drafter, tmp_path / "ckpt", hf_config), tmp_path / "hf", progress=False
    )
    loaded = DFlashDraftModel.from_pretrained(path)
    assert loaded.block_size == config.block_size and list(loaded.target_layer_ids) == list(
        config.target_layer_ids
    )


def test_history_plot(tmp_path):
    import json

    from jaxdd.train.plot import plot_history

    history = {
        "step": [100, 200],
        "train_loss": [5.0, 4.0],
        "validation_loss": [5.1, 4.2],
        "accuracy": [[0.3, 0.2]] * 2,
    }
    (tmp_path / "drafter_history.json").write_text(json.dumps(history))
    out = plot_history(tmp_path / "drafter_history.json", tmp_path / "drafter.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_run_resumed_from_its_last_save_equals_the_uninterrupted_run(tmp_path):
    from jaxdd.train.resume import TrainingCheckpoints, step_rng

    config = KimiConfig.from_hf(SMALL)
    corpus = np.random.default_rng(3).integers(2, 512, 4000).astype(np.int32)

    def run(model, optimizer, steps):
        for step in steps:
            tokens = jnp.asarray(windows(corpus, 2, 17, step_rng(7, step)))
            train_step(model, optimizer, tokens)

    def fresh(seed=0):
        model = KimiTarget(config, jnp.float32, rngs=nnx.Rngs(seed))
        return model, make_optimizer(model, steps=6, peak_lr=3e-3)

    whole = fresh()
    run(*whole, range(1, 7))
    first = fresh()
    run(*first, range(1, 4))
    checkpoints = TrainingCheckpoints(tmp_path / "checkpoints")
    assert checkpoints.restore(*first) == (0, None)  # nothing saved yet
    assert not checkpoints.maybe_save(3, *first, {"step": [3]})  # minutes apart
    assert checkpoints.maybe_save(3, *first, {"step": [3]}, force=True)
    resumed = fresh(seed=1)  # other weights: the restore must replace them all
    step, history = TrainingCheckpoints(tmp_path / "checkpoints").restore(*resumed)
    assert (step, history) == (3, {"step": [3]})
    run(*resumed, range(4, 7))
    for a, b in zip(
        jax.tree.leaves(nnx.state(whole[0])), jax.tree.leaves(nnx.state(resumed[0])), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_validation_loss_by_position_bucket():
    from jaxdd.train.target import bucket_losses, position_buckets

    assert position_buckets(2048) == [(0, 127), (128, 255), (256, 511), (512, 1023), (1024, 2047)]
    assert position_buckets(256) == [(0, 127), (128, 255)]
    assert position_buckets(100) == [(0, 99)]
    per_position = np.concatenate([np.full(128, 3.0), np.full(128, 2.0), np.arange(256.0)])
    assert bucket_losses(per_position) == {"0-127": 3.0, "128-255": 2.0, "256-511": 127.5}


def test_continuations_after_contexts_of_any_length_and_their_buckets(tmp_path):
    from jaxdd.train.continuations import (
        TrainingData,
        greedy_continuations,
        padded_length,
        target_features,
    )
    from jaxdd.train.drafter import random_anchors

    target = jaxdd.Target(KimiTarget(KimiConfig.from_hf(SMALL), jnp.float32, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(2, 512, n).astype(np.int32) for n in (9, 3, 6)]
    sequences = greedy_continuations(target, prompts, 4, batch=2)
    assert sequences.shape == (3, 13)
    for prompt, row in zip(prompts, sequences, strict=True):
        greedy = target.generate(prompt.tolist(), max_new_tokens=4, stop_token_ids=[]).tokens
        n = len(prompt)
        assert row[:n].tolist() == prompt.tolist() and row[n : n + 4].tolist() == greedy
        assert not row[n + 4 :].any()  # padded with 0

    assert [padded_length(n) for n in (1, 256, 257, 1100, 2048)] == [256, 256, 512, 2048, 2048]
    contexts = np.array([64, 300, 100, 900])
    data = TrainingData(
        {"train": rng.integers(2, 512, (4, 900 + 8)).astype(np.int32)}, {"train": contexts}, 8
    )
    buckets = data.buckets(target.model, (0,), "train", tmp_path, chunk_tokens=512)
    assert sorted(buckets) == [256, 512, 1024]
    assert buckets[256].contexts.tolist() == [64, 100] and buckets[1024].tokens.shape == (1, 1024)
    assert buckets[512].features.shape == (1, 512, SMALL["hidden_size"])
    np.testing.assert_array_equal(buckets[512].tokens[0], data.tokens["train"][1, :512])
    # the features file holds each row's bf16 features; a second call (a resumed run) keeps it
    rows = buckets[256]
    expected = target_features(target.model, jnp.asarray(rows.tokens), (0,)).astype(jnp.bfloat16)
    np.testing.assert_array_equal(rows.features.read([1, 0]), np.asarray(expected)[[1, 0]])
    written = rows.features.path.stat().st_mtime_ns
    again = data.buckets(target.model, (0,), "train", tmp_path, chunk_tokens=512)
    assert again[256].features.path.stat().st_mtime_ns == written

    first = np.array([64, 300, 5])
    anchors = random_anchors(rng, 3, 50, first + 8, 4, first)
    assert (anchors >= first[:, None]).all() and (anchors <= (first + 4)[:, None]).all()
    assert len(np.unique(anchors[0])) == 5  # every start with a whole block after it


def test_packed_blocks_draft_as_each_block_alone_at_inference():
    from jaxdd.cache import DraftCache
    from jaxdd.config import DrafterConfig
    from jaxdd.models.drafter import DFlashDrafter
    from jaxdd.train.blocks import block_logits
    from jaxdd.train.continuations import target_features
    from jaxdd.train.drafter import drafter_hf_config

    target = KimiTarget(KimiConfig.from_hf(SMALL), jnp.float32, rngs=nnx.Rngs(0))
    config = DrafterConfig.from_hf(drafter_hf_config(target.config, block_size=4, layers=2))
    drafter = DFlashDrafter(config, jnp.float32, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(2, 512, (2, 32)), jnp.int32)
    features = target_features(target, tokens, config.target_layer_ids)
    anchors = jnp.asarray([[1, 9, 10, 28], [20, 3, 20, 12]], jnp.int32)  # overlapping blocks
    logits, labels = block_logits(drafter, target, tokens, features, anchors)
    assert logits.shape == (8, 3, 512)
    for row, (sequence, anchor) in enumerate(np.ndindex(2, 4)):
        a = int(anchors[sequence, anchor])
        # inference: the context before the anchor injected into a cache of its own
        cache = DraftCache.zeros(config, 1, 32, jnp.float32)
        context = features[sequence : sequence + 1, :a]
        cache = drafter.inject(cache, context, jnp.arange(a)[None], jnp.asarray([a]))
        alone, _ = drafter.draft_logits(
            target, cache, tokens[sequence, a][None], jnp.asarray([a]), jnp.asarray([4]), 4
        )
        np.testing.assert_allclose(logits[row], alone[0], atol=1e-4, rtol=1e-4)
        assert labels[row].tolist() == tokens[sequence, a + 1 : a + 4].tolist()
