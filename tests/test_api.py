"""The host-side API: loading, checkpoints, and clear errors for bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxdd
from jaxdd.testing.reference import TINY_K2, hf_model
from jaxdd.weights.checkpoint import is_jaxdd_checkpoint


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf")
    hf_model(TINY_K2, seed=0).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def target(hf_dir):
    return jaxdd.load_target(hf_dir, dtype="float32")


IDS = np.array([[5, 17, 3, 250, 9, 1]])


@pytest.mark.slow
def test_checkpoint_round_trip(target, tmp_path):
    saved = jaxdd.save_target(target.model, tmp_path / "ckpt")
    assert is_jaxdd_checkpoint(saved)
    # no staging directory left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    restored = jaxdd.load_target(saved, dtype="float32")
    assert restored.config == target.config
    np.testing.assert_array_equal(restored.logits(IDS), target.logits(IDS))
    as_bf16 = jaxdd.load_target(saved, dtype="bfloat16")
    assert (
        as_bf16.dtype == np.dtype("bfloat16")
        and as_bf16.model.layers[1].mlp.router.bias.dtype == np.float32
    )
    with pytest.raises(FileExistsError, match="already exists"):
        jaxdd.save_target(target.model, saved)


def test_failed_save_leaves_nothing(target, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("orbax.checkpoint.StandardCheckpointer.save", fail)
    with pytest.raises(
        jaxdd.CheckpointError, match=r"ckpt: cannot write \(disk full\); nothing was kept"
    ):
        jaxdd.save_target(target.model, tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_out_of_vocabulary_token(target):
    with pytest.raises(
        jaxdd.InputError, match=r"token_ids: id 256 at \(0, 2\) outside the vocabulary \[0, 256\)"
    ):
        target.logits([[1, 2, 256]])
    with pytest.raises(jaxdd.InputError, match="id -1"):
        target.logits([[-1]])
    with pytest.raises(jaxdd.InputError, match="integer array"):
        target.logits([[0.5]])


def test_cache_overflow(target):
    cache = target.new_cache(1, 4)
    out = target.forward([[1, 2, 3]], cache)
    with pytest.raises(
        jaxdd.InputError, match="cache overflow: row 0 holds 3 tokens, 2 more need 5 slots"
    ):
        target.forward([[4, 5]], out.cache)


def test_positions_beyond_cache(target):
    with pytest.raises(
        jaxdd.InputError, match=r"positions: 8 at \(0, 1\) is beyond the cache \(8 slots\)"
    ):
        target.forward([[1, 2]], target.new_cache(1, 8), positions=[[0, 8]])


def test_bad_visibility_and_taps(target):
    cache = target.new_cache(1, 8)
    with pytest.raises(
        jaxdd.InputError, match=r"visible: expected a bool mask of shape \(1, 2, 2\)"
    ):
        target.forward([[1, 2]], cache, visible=np.ones((1, 3, 3), bool))
    with pytest.raises(jaxdd.InputError, match="must see itself"):
        target.forward([[1, 2]], cache, visible=np.zeros((1, 2, 2), bool))
    with pytest.raises(jaxdd.InputError, match=r"taps: layer\(s\) \[3\] outside \[0, 3\)"):
        target.forward([[1, 2]], cache, taps=(0, 3))
    with pytest.raises(jaxdd.InputError, match="batch 2 does not match the cache batch 1"):
        target.forward([[1], [2]], cache)


def test_bad_checkpoint_directories(hf_dir, tmp_path):
    with pytest.raises(jaxdd.CheckpointError, match="not a directory"):
        jaxdd.load_target(tmp_path / "nowhere")
    with pytest.raises(jaxdd.CheckpointError, match="no config.json"):
        jaxdd.load_target(tmp_path)

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((hf_dir / "config.json").read_text())
    tensors = load_file(hf_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    tensors["model.layers.1.mlp.extra.weight"] = np.zeros(2, np.float32)
    tensors["model.layers.0.self_attn.o_proj.weight"] = np.zeros((3, 3), np.float32)
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(jaxdd.CheckpointError) as error:
        jaxdd.load_target(broken)
    message = str(error.value)  # one error lists every problem
    assert "missing tensor: model.layers.1.mlp.experts.3.up_proj.weight" in message
    assert "unexpected tensor: model.layers.1.mlp.extra.weight" in message
    assert (
        "model.layers.0.self_attn.o_proj.weight: shape [3, 3], the config needs [64, 64]" in message
    )

    (broken / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-1-of-2.safetensors"}})
    )
    with pytest.raises(jaxdd.CheckpointError, match="names missing shard"):
        jaxdd.load_target(broken)


def test_equal_models_share_one_jit_structure(hf_dir, target):
    """Decoders built one after another reuse compiled rounds
    without jit comparing their module graphs again."""
    from jaxdd.runtime.jit_state import split_module

    again = jaxdd.load_target(hf_dir, dtype="float32")  # a separate, equal model
    spec, weights = split_module(again.model)
    assert spec is split_module(target.model)[0]
    assert weights[0] is not split_module(target.model)[1][0]  # only the structure is shared
    assert (
        jaxdd.SpeculativeDecoder(again)._models.target_structure
        is jaxdd.SpeculativeDecoder(target)._models.target_structure
    )
    assert split_module(jaxdd.load_target(hf_dir, dtype="bfloat16").model)[0] is not spec
