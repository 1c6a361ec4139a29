"""8 simulated CPU devices: tensor- and expert-parallel
placements give the same tokens as one device."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxdd
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.models.quant import DENSE
from jaxdd.planning.fit import PlanOptions, plan
from jaxdd.runtime.compile_time import compile_clock
from jaxdd.runtime.sharding import make_mesh, shard_module
from jaxdd.testing.hf_layouts import write_k2_instruct_fp8, write_k25_int4
from jaxdd.testing.reference import (
    SHARDABLE_DRAFTER,
    SHARDABLE_K2,
    rel_err,
    save_random_pair,
)
from jaxdd.weights.hf_loader import load_hf_target
from jaxdd.weights.hf_reader import HFCheckpoint

PROMPT = [5, 17, 3, 250, 9, 1, 77]
METHODS = {"ar": {}, "dflash": {}, "ddtree": {"budget": 12}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharding")
    save_random_pair(root, SHARDABLE_K2, SHARDABLE_DRAFTER, seed=7)
    write_k25_int4(root / "target", root / "int4")
    write_k2_instruct_fp8(root / "target", root / "fp8")
    return root


def decoder(checkpoints, target="target", mode=None) -> SpeculativeDecoder:
    """The pair loaded onto 8 devices in ``mode`` (None: one device)."""
    devices = 1 if mode is None else 8
    return SpeculativeDecoder(
        *jaxdd.load_pair(
            checkpoints / target, checkpoints / "drafter", "float32", devices, mode or "tp"
        )
    )


def generate(dec: SpeculativeDecoder, prompt=PROMPT) -> dict[str, list[int]]:
    return {
        m: dec.generate(prompt, method=m, max_new_tokens=16, stop_token_ids=[], **kw).tokens
        for m, kw in METHODS.items()
    }


@pytest.fixture(scope="module")
def single_device(checkpoints):
    return {name: generate(decoder(checkpoints, name)) for name in ("target", "int4")}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_same_tokens_as_one_device_and_no_recompiles(checkpoints, single_device, mode):
    dec = decoder(checkpoints, mode=mode)
    assert generate(dec) == single_device["target"]
    with compile_clock() as compiles:
        generate(dec, [9, 8, 7, 6, 5])  # same shape buckets: nothing new to compile
    assert compiles.count == 0


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["target", "int4", "fp8"])
@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_loading_onto_the_mesh_reads_each_device_its_part(checkpoints, layout, mode, monkeypatch):
    """Loaded straight onto the mesh: the arrays and shardings of loading whole and then
    sharding, while each device read from disk only its part of the routed experts: the elements
    read are those of the distinct shards (JAX reads a replicated array once for all devices)."""
    mesh = make_mesh(8)
    whole = jaxdd.load_target(checkpoints / layout, dtype="float32").model
    shard_module(whole, mesh, mode)
    read = []
    original = HFCheckpoint._read

    def counted(self, name, region=None):
        array = original(self, name, region)
        read.append((name, array.size))
        return array

    monkeypatch.setattr(HFCheckpoint, "_read", counted)
    placed = jaxdd.load_target(checkpoints / layout, dtype="float32", mesh=mesh, moe=mode).model
    held = 0
    for (path, a), b in zip(_leaves(placed), [b for _, b in _leaves(whole)], strict=True):
        assert a.sharding == b.sharding and np.array_equal(np.asarray(a), np.asarray(b)), path
        # routed experts
        if a.ndim == 3 and path[-2].key in ("gate", "up", "down") and path[-3].key == "mlp":
            held += _distinct_shard_elements(a)
    assert held and sum(size for name, size in read if ".mlp.experts." in name) == held


def test_dense_from_quantized_reads_whole_groups(checkpoints):
    """Dense weights from INT4 / FP8 storage, split over devices where
    groups or blocks straddle them: each part is dequantized from the
    whole groups around it and cut, giving the whole weight's values."""
    mesh = make_mesh(8)
    for layout in ("int4", "fp8"):
        whole = load_hf_target(checkpoints / layout, jnp.float32, experts=DENSE)
        placed = load_hf_target(
            checkpoints / layout, jnp.float32, experts=DENSE, placement=(mesh, "tp")
        )
        for (path, a), (_, b) in zip(_leaves(placed), _leaves(whole), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b)), (layout, path)
        assert placed.layers[1].mlp.down.weight[...].sharding.spec == P(None, "model", None)


def _distinct_shard_elements(array: jax.Array) -> int:
    indices = array.sharding.devices_indices_map(array.shape).values()
    shards = {
        tuple(s.indices(n)[:2] for s, n in zip(index, array.shape, strict=True))
        for index in indices
    }
    return sum(math.prod(stop - start for start, stop in shard) for shard in shards)


def _leaves(model):
    return jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model)))


@pytest.mark.slow
def test_int4_experts_expert_parallel(checkpoints, single_device):
    dec = decoder(checkpoints, "int4", mode="ep")
    gate = dec.target.model.layers[1].mlp.gate
    assert gate.packed[...].sharding.spec == P("model", None, None)
    experts = SHARDABLE_K2["n_routed_experts"]
    assert gate.packed[...].addressable_shards[0].data.shape[0] == experts // 8
    assert generate(dec) == single_device["int4"]


@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_parameters_and_caches_are_sharded(checkpoints, mode):
    dec = decoder(checkpoints, mode=mode)
    model = dec.target.model
    expected = [
        (model.embed, P("model", None)),
        (model.lm_head, P(None, "model")),
        (model.layers[1].attn.q_b_proj, P(None, "model", None)),
        (model.layers[1].attn.o_proj, P("model", None, None)),
        (model.layers[0].mlp.gate, P(None, "model")),
        (
            model.layers[1].mlp.gate.weight,
            P("model", None, None) if mode == "ep" else P(None, None, "model"),
        ),
        (
            model.layers[1].mlp.down.weight,
            P("model", None, None) if mode == "ep" else P(None, "model", None),
        ),
        (dec.drafter.layers[0].attn.k_proj, P(None, "model", None)),
    ]
    for param, spec in expected:
        array = param[...]
        assert array.sharding.spec == spec
        assert len(array.sharding.device_set) == 8
        assert array.addressable_shards[0].data.size * 8 == array.size
    state = dec.admitted([PROMPT], max_new_tokens=8).state
    for latent in state.target_cache.latent:
        assert latent.sharding.is_fully_replicated  # one latent row serves every head
        assert len(latent.sharding.device_set) == 8
    for keys in state.draft_cache.keys:
        assert keys.sharding.spec == P(None, "model")


def test_vocab_parallel_logits(checkpoints):
    """Embedding lookup and lm_head split by vocabulary give the one-device logits."""
    one = jaxdd.load_target(checkpoints / "target", dtype="float32")
    sharded = jaxdd.load_target(checkpoints / "target", dtype="float32")
    shard_module(sharded.model, make_mesh(8), "tp")
    ids = [[5, 17, 3, 250, 9, 1, 77, 255, 0]]
    assert rel_err(jaxdd.Target(sharded.model).logits(ids), one.logits(ids)) < 1e-6


@pytest.mark.slow
def test_plan_reduced_depth_full_width():
    """The full Kimi K2.6 width (384 INT4 experts of 7168 x 2048, vocab 163840) at 2
    layers, compiled ahead of time on 8 simulated devices without allocating the model."""
    result = plan(
        "tests/fixtures/kimi_k25_config.json",
        "tests/fixtures/kimi_k26_dflash_config.json",
        PlanOptions(devices=8, moe="ep", budget=8, max_len=256, layers=2),
    )
    per_device = result["per_device_bytes"]
    assert result["routed_experts"] == "int4" and result["layers"] == 2
    # 384 experts x 3 x 7168 x 2048 INT4 values = 8.46e9
    # bytes, split 8 ways; plus scales, attention, embeddings.
    assert 1.5e9 < per_device["target_weights"] < 2.5e9
    assert per_device["temporaries"] > 0 and result["hardware"]["name"] == "cpu"
    assert result["fits"] == (per_device["total"] <= result["hardware"]["memory_bytes"])
    # As stored, all devices together: embed + lm_head 4.70e9, experts 8.46e9 + scales
    # 0.53e9, dense MLP 0.79e9, attention 2 x 0.20e9, shared expert and router 0.10e9.
    assert 1.48e10 < result["stored_bytes"]["target"] < 1.57e10


def _set_dispatch(target: jaxdd.Target, dispatch: str) -> jaxdd.Target:
    for layer in target.model.layers:
        if hasattr(layer.mlp, "dispatch"):
            layer.mlp.dispatch = dispatch
    return jaxdd.Target(target.model)


@pytest.mark.slow
@pytest.mark.parametrize(("experts", "mode"), [("int4", None), ("int4", "ep"), ("fp8", "tp")])
def test_expert_dispatches_agree(checkpoints, experts, mode):
    """All-experts, gathered (each pair's expert gathered, quantized, then dequantized: what
    decode steps of quantized MoEs use), grouped (ragged_dot), one-expert-at-a-time (scan),
    skipping (the chosen experts only) and tiled (one expert's tile per step, dequantized
    there) give the same logits for INT4 experts on one device and inside the expert-parallel
    shard_map, and FP8 experts inside the tensor-parallel one. Nine tokens of top-4 over 16
    experts: 36 pairs, so this forces ``gathered`` past where auto picks it."""
    ids = [[5, 17, 3, 250, 9, 1, 77, 255, 0]]
    logits = {}
    for dispatch in ("dense", "gathered", "grouped", "scan", "skipping", "tiled"):
        target = jaxdd.load_target(checkpoints / experts, dtype="float32")
        if mode is not None:
            shard_module(target.model, make_mesh(8), mode)
        logits[dispatch] = _set_dispatch(target, dispatch).logits(ids)
    for dispatch, value in logits.items():
        assert rel_err(value, logits["dense"]) < 1e-6, dispatch


@pytest.mark.slow
def test_pallas_tree_attention_per_device_heads(checkpoints, single_device):
    """The Pallas kernel (interpreted here) runs under shard_map on each device's heads."""
    dec = decoder(checkpoints, mode="tp")
    pallas = SpeculativeDecoder(dec.target, dec.drafter, attention="pallas")
    tokens = pallas.generate(
        PROMPT, method="ddtree", max_new_tokens=16, stop_token_ids=[], budget=12
    ).tokens
    assert tokens == single_device["target"]["ddtree"]
