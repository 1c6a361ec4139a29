"""Decode against its memory floor on this CPU: a memory-bound INT4 MoE target (128 routed experts, top 8, far past
the L3 cache) loaded through ``jaxdd.load_target``.

    python benchmarks/moe_bandwidth.py [--repeats 20]

A decode step reads its weights once and only the experts its tokens chose, so its floor is (bytes it must read)
/ (this machine's read bandwidth, measured here as a jitted sum over 1 GiB). Bytes: every non-expert weight but
the embedding (one row per token), the distinct chosen experts' INT4 words and scales, the KV slots attention
reads. Timed: the AR step and a DFlash verify-sized target forward (16 tokens: 128 pairs, ~81 distinct experts
per layer under uniform routing), with the dispatch the backend picks now (``gathered`` for few pairs) and with
the one it picked before (every expert dequantized: ``dense`` for one token, ``scan`` for 16), one after the
other per repeat. Writes benchmarks/results/moe_bandwidth.json and moe_bandwidth.png.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from transformers import DeepseekV3Config

import jaxdd
from jaxdd.checkpoint import groups_of, write_checkpoint
from jaxdd.config import KimiConfig
from jaxdd.decoder import SpeculativeDecoder
from jaxdd.quant import ExpertFormat, ExpertWeights
from jaxdd.target import KimiTarget, abstract_target
from jaxdd.testing.benchmark import median_ms, timed, write_result
from jaxdd.testing.reference import TINY_K2

RESULTS = Path(__file__).parent / "results"
SHAPE = TINY_K2 | dict(  # 1 dense + 5 MoE layers; the routed experts are 0.57 GB of INT4, the rest ~0.3 GB fp32
    vocab_size=32768,
    hidden_size=1024,
    intermediate_size=2048,
    moe_intermediate_size=512,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=8,
    n_routed_experts=128,
    num_experts_per_tok=8,
    q_lora_rank=384,
    kv_lora_rank=256,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
)
INT4 = ExpertFormat("int4")
PROMPT = list(range(3, 67))
VERIFY_TOKENS = 16


def write_random_int4_target(directory: Path, seed: int = 0) -> KimiConfig:
    """A jaxdd checkpoint of ``SHAPE`` with random weights: normal fp32, random INT4 words, scales near 0.002."""
    config = KimiConfig.from_hf(DeepseekV3Config(**SHAPE).to_dict())
    rng = np.random.default_rng(seed)

    def value(leaf):
        if leaf.dtype == jnp.int32:
            return rng.integers(-(2**31), 2**31, leaf.shape, dtype=np.int64).astype(np.int32)
        if leaf.dtype == jnp.bfloat16:
            return rng.uniform(0.001, 0.003, leaf.shape).astype(jnp.bfloat16)
        return (0.02 * rng.standard_normal(leaf.shape)).astype(leaf.dtype)

    abstract = nnx.to_pure_dict(abstract_target(config, jnp.float32, INT4)[1])
    groups = ((name, jax.tree.map(value, tree)) for name, tree in groups_of(abstract))
    write_checkpoint(directory, "target", config.to_hf(), jnp.float32, groups, INT4)
    return config


def read_bandwidth_gb_s() -> float:
    """GB/s of a jitted fp32 sum over 1 GiB, the best of 10 (a peak, as STREAM reports): what XLA:CPU reaches
    reading memory here."""
    data = jnp.ones((2**28,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(data).block_until_ready()
    return data.nbytes / min(timed(lambda: total(data).block_until_ready(), 1)[1] for _ in range(10)) / 1e9


def bytes_per_step(model: KimiTarget, tokens: int, slots: int) -> dict[str, float]:
    """What one target forward of ``tokens`` tokens must read: non-expert weights (of the embedding one row per
    token), the expected distinct experts per MoE layer under uniform routing, the KV slots attention reads."""
    c = model.config
    total = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    embed = model.embed[...].nbytes
    experts = [m for _, m in nnx.iter_modules(model) if isinstance(m, ExpertWeights)]
    expert_bytes = sum(x.nbytes for m in experts for x in m.stored())
    distinct = c.n_routed_experts * (1 - (1 - c.num_experts_per_tok / c.n_routed_experts) ** tokens)
    return {
        "non_expert": total - embed - expert_bytes + tokens * embed // c.vocab_size,
        "experts": expert_bytes * distinct / c.n_routed_experts,
        "kv": c.num_hidden_layers * slots * (c.kv_lora_rank + c.qk_rope_head_dim) * 4,
        "distinct_experts_per_layer": distinct,
    }


def with_dispatch(model: KimiTarget, dispatch: str) -> jaxdd.Target:
    """The model with every MoE layer forced to ``dispatch`` ("auto": the backend's choice)."""
    for layer in model.layers:
        if hasattr(layer.mlp, "dispatch"):
            layer.mlp.dispatch = dispatch
    return jaxdd.Target(model)


def ar_step_ms(target: jaxdd.Target, repeats: int) -> tuple[float, int]:
    """(median ms of an AR decode round, cache slots)."""
    decoder = SpeculativeDecoder(target)
    plan, state = decoder.start([PROMPT], method="ar", max_new_tokens=512, stop_token_ids=[])
    holder = {"state": state}

    def step():
        holder["state"], report = decoder.step(plan, holder["state"])
        return report

    return median_ms(step, repeats), state.target_cache.latent[0].shape[1]


def verify_ms(target: jaxdd.Target, repeats: int, slots: int) -> float:
    """Median ms of a target forward of ``VERIFY_TOKENS`` tokens after the prompt, left uncommitted."""
    holder = {"cache": target.forward(np.array([PROMPT]), cache=target.new_cache(1, slots)).cache}
    ids = np.array([(PROMPT * 4)[:VERIFY_TOKENS]])

    def verify():
        out = target.forward(ids, cache=holder["cache"], commit=False)
        holder["cache"] = out.cache
        return out.logits

    return median_ms(verify, repeats)


def measure(model: KimiTarget, repeats: int) -> dict:
    """Median ms of the AR step and of the verify forward with the dispatch picked now and the former one."""
    out = {"ar": {}, "verify": {}}
    for name, (ar_dispatch, verify_dispatch) in {"now": ("auto", "auto"), "before": ("dense", "scan")}.items():
        jax.clear_caches()
        out["ar"][name], out["slots"] = ar_step_ms(with_dispatch(model, ar_dispatch), repeats)
        out["verify"][name] = verify_ms(with_dispatch(model, verify_dispatch), repeats, out["slots"])
    with_dispatch(model, "auto")
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(7, 4))
    labels = ["AR step", f"verify {VERIFY_TOKENS} tokens"]
    x = np.arange(2)
    bars = {"floor": "floor_ms", "now": "now_ms", "before": "before_ms"}
    for offset, (name, key) in zip((-0.27, 0, 0.27), bars.items(), strict=True):
        values = [report[k][key] for k in ("ar", "verify")]
        bars = axis.bar(x + offset, values, 0.26, label=name)
        axis.bar_label(bars, fmt="%.1f", fontsize=8)
    axis.set_yscale("log")
    axis.set_xticks(x, labels)
    axis.set_ylabel("ms (log)")
    axis.set_title(f"INT4 MoE, 128 experts top 8, read bandwidth {report['read_gb_s']:.1f} GB/s")
    axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    bandwidth = read_bandwidth_gb_s()
    with tempfile.TemporaryDirectory() as root:
        write_random_int4_target(Path(root) / "int4")
        target = jaxdd.load_target(Path(root) / "int4", dtype="float32")
    times = measure(target.model, args.repeats)
    report = {"shape": SHAPE, "read_gb_s": bandwidth}
    for label, tokens in (("ar", 1), ("verify", VERIFY_TOKENS)):
        needed = bytes_per_step(target.model, tokens, times["slots"])
        floor_ms = (needed["non_expert"] + needed["experts"] + needed["kv"]) / bandwidth / 1e6
        report[label] = {
            "tokens": tokens,
            "bytes": needed,
            "floor_ms": floor_ms,
            "now_ms": times[label]["now"],
            "before_ms": times[label]["before"],
            "now_over_floor": times[label]["now"] / floor_ms,
            "before_over_floor": times[label]["before"] / floor_ms,
        }
        now, before = times[label]["now"], times[label]["before"]
        print(f"{label}: floor {floor_ms:.2f} ms, now {now:.2f} ms, before {before:.2f} ms")
    write_result(RESULTS / "moe_bandwidth.json", report)
    plot(report, RESULTS / "moe_bandwidth.png")


if __name__ == "__main__":
    main()
