"""The roofline (jaxdd.planning.roofline): each round's FLOPs per device against a count by
hand, the dtype the routed experts multiply in, and the round time it gives."""

from __future__ import annotations

import pytest

from jaxdd.planning.capacity import shard_bytes
from jaxdd.planning.fit import PlanOptions, plan
from jaxdd.planning.hardware import GPUS
from jaxdd.planning.pair import abstract_models, read_configs
from jaxdd.planning.roofline import ModelWork
from jaxdd.planning.traffic import (
    ModelBytes,
    PairAccount,
    Spread,
    floor_seconds,
    traffic_table,
)
from jaxdd.runtime.sharding import make_mesh

CONFIGS = ("tests/fixtures/kimi_k25_config.json", "tests/fixtures/kimi_k26_dflash_config.json")
LAYERS = 3  # full width, one dense and two MoE layers: the count below is per layer


def hand_count(tokens: int, context: int, block: int) -> float:
    """K2.6 at full width on 8 devices under TP, the latent cache replicated, one row: FLOPs per
    device of a round verifying ``tokens`` tokens (``block``: the drafter's, 0 for AR), from the
    models' shapes (2 per multiply-add; per device: the heads, MLP widths and vocab / 8)."""
    d, heads, q_lora, nope, rope, v_dim, latent = 7168, 64, 1536, 128, 64, 128, 512
    ffn, moe_ffn, experts, top_k, vocab, devices = 18432, 2048, 384, 8, 163840, 8
    dense_layers, moe_layers = 1, LAYERS - 1
    # q_a and kv_a replicated; q_b, k_up, v_up and o_proj by heads
    attention_weights = d * q_lora + d * (latent + rope)
    attention_weights += (q_lora * heads * (nope + rope) + heads * latent * (nope + v_dim)) / 8
    attention_weights += heads * v_dim * d / 8
    mlp = 3 * d * ffn / devices
    shared = 3 * d * moe_ffn / devices
    router = 3 * d * experts  # replicated, three bf16 passes of its fp32 input
    per_token = LAYERS * attention_weights + dense_layers * mlp + moe_layers * (shared + router)
    per_token += d * vocab / devices  # the lm_head
    routed = moe_layers * top_k * 3 * d * moe_ffn / devices
    # scores over latent and rope rows, values over latent rows; the cache and the tree's tail
    attention = 2 * tokens * heads / devices * (context + tokens) * (2 * latent + rope) * LAYERS
    flops = 2 * tokens * (per_token + routed) + attention
    if block:
        # the drafter: 6 layers of 64 query / 8 KV heads of 128, MLP 18432, fc from 6 taps
        kv = 2 * d * 8 * 128 / devices
        layer = d * 64 * 128 / devices + kv + 64 * 128 * d / devices + 3 * d * ffn / devices
        drafter = 6 * d * d + 6 * layer + 6 * kv  # fc, layers, the injected context's K/V
        flops += 2 * block * drafter + 2 * (block - 1) * d * vocab / devices
        flops += 2 * block * (64 / devices) * (context + block) * 128 * 2 * 6
    return flops


@pytest.mark.parametrize("context", [8192, 131072])
def test_round_flops_match_a_hand_count(context):
    options = PlanOptions(devices=8, moe="tp", layers=LAYERS, max_len=context, compile_round=False)
    result = plan(*CONFIGS, options)
    rows = {row["round"]: row for row in result["traffic_by_layout"]["replicated"]}
    expected = {
        "ar": hand_count(1, context, 0),
        "dflash": hand_count(8, context, 8),
        "ddtree 16": hand_count(17, context, 8),
        "ddtree 64": hand_count(65, context, 8),
    }
    for name, flops in expected.items():
        assert rows[name]["flops"] == pytest.approx(flops, rel=0.05), name
        assert sum(rows[name]["flops_by_part"].values()) == rows[name]["flops"]
    # attention over the cache grows with the context; weights do not
    share = rows["ddtree 64"]["flops_by_part"]["attention"] / rows["ddtree 64"]["flops"]
    assert share > 0.8 if context == 131072 else share < 0.35


def test_experts_multiply_in_fp32_where_a_gpu_gathers_int4():
    """INT4 experts: a GPU gathers them for few (token, expert) pairs (its Triton kernel sums in
    fp32 on the CUDA cores), and past as many pairs as experts runs them dequantized in bf16; a
    TPU runs all in bf16."""
    result = plan(*CONFIGS, PlanOptions(devices=8, moe="tp", layers=LAYERS, compile_round=False))
    rows = {row["round"]: row for row in result["traffic"]}
    assert rows["ddtree 16"]["flops_by_dtype"]["gpu"]["fp32"] > 0
    assert "fp32" not in rows["ddtree 64"]["flops_by_dtype"]["gpu"]
    assert set(rows["ddtree 16"]["flops_by_dtype"]["tpu"]) == {"bf16"}
    for row in rows.values():
        for by_dtype in row["flops_by_dtype"].values():
            assert sum(by_dtype.values()) == pytest.approx(row["flops"])


def test_round_time_is_the_slower_of_memory_and_compute_plus_the_link():
    h200 = GPUS["h200"]
    traffic = {"read_total": 4.8e9, "allreduce_bytes": 0.0, "allreduces": 10}  # 1 ms of reads
    link = 10 * h200.collective_latency
    for flops, bound in ((0.5 * 989e9, "memory"), (2 * 989e9, "compute")):
        times = floor_seconds(traffic | {"flops_by_dtype": {"gpu": {"bf16": flops}}}, h200)
        assert times["compute_s"] == pytest.approx(flops / 989e12)
        assert times["bound"] == bound
        assert times["round_s"] == pytest.approx(max(1e-3, flops / 989e12) + link)
    # fp32 on the CUDA cores: 67 TFLOPS
    fp32 = floor_seconds(traffic | {"flops_by_dtype": {"gpu": {"fp32": 67e9}}}, h200)
    assert fp32["compute_s"] == pytest.approx(1e-3)


def test_a_table_of_several_rows():
    """``traffic_table(batch=4)``: every row attends over its own cache, the weights are
    multiplied for all rows' tokens alike, and tokens/s counts all rows."""
    config, drafter_config, experts = read_configs(*CONFIGS, LAYERS)
    mesh = make_mesh(8)
    models, _, _ = abstract_models(config, drafter_config, experts, mesh, "tp")
    model_bytes, work = ModelBytes.of(*models, shard_bytes), ModelWork.of(*models, shard_bytes)
    one, four = (
        traffic_table(PairAccount(config, model_bytes, work), Spread(8, "tp"), 8192, 8, batch=rows)
        for rows in (1, 4)
    )
    for single, batched in zip(one, four, strict=True):
        for part in ("attention", "matmuls", "experts", "drafter", "drafter_attention"):
            assert batched["flops_by_part"][part] == pytest.approx(
                4 * single["flops_by_part"][part]
            )
        for times in batched["targets"].values():
            assert times["tokens_per_s"] == pytest.approx(4 * batched["tau"] / times["round_s"])
