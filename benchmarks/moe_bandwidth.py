"""Decode against its memory floor on this CPU: a memory-bound INT4 MoE target (128
routed experts, top 8, far past the L3 cache) loaded through ``jaxdd.load_target``.

    python benchmarks/moe_bandwidth.py [--repeats 20]

A decode step reads its weights once and only the experts its tokens chose, so its floor is (bytes
it must read) / (this machine's read bandwidth: the best of a jitted sum, XLA's matvec and the dense
matvec kernel over 1 GiB). Bytes: every non-expert weight but the embedding (one row per token), the
distinct chosen experts' INT4 words and scales, the KV slots attention reads. This host's bandwidth
drifts by half between minutes (other tenants), so the AR step with the CPU kernels is timed in
rounds that alternate with the bandwidth probe: each round's ratio is its median step over the floor
at that round's bandwidth, and the result is the median round. Also timed: a DFlash verify-sized
target forward (16 tokens: 128 pairs, ~81 distinct experts per layer under uniform routing), with
what the backend picks now (``gathered`` through the INT4 kernel and, for one token, the dense
weights through the dense matvec kernel: ``jaxdd.runtime.cpu_kernels``), with what it picks without
the kernels (``gathered`` through XLA's dequantization for one token, ``scan`` for 16, XLA's
matmuls) and with what it picked first (every expert dequantized: ``dense`` for one token, ``scan``
for 16). Writes benchmarks/results/moe_bandwidth.json and moe_bandwidth.png.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from transformers import DeepseekV3Config

import jaxdd
from jaxdd.config import KimiConfig
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.models.quant import ExpertFormat, ExpertWeights
from jaxdd.models.target import KimiTarget, abstract_target
from jaxdd.runtime import cpu_kernels
from jaxdd.runtime.backend import Backend
from jaxdd.testing.benchmark import median_ms, timed, write_result
from jaxdd.testing.reference import TINY_K2
from jaxdd.testing.rounds import BatchRound
from jaxdd.weights.checkpoint import CheckpointHeader, groups_of, write_checkpoint

RESULTS = Path(__file__).parent / "results"
# 1 dense + 5 MoE layers; the routed experts are 0.57 GB of INT4, the rest ~0.3 GB fp32
SHAPE = TINY_K2 | dict(
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
VARIANTS = {  # name: (AR dispatch, verify dispatch, the CPU kernels)
    "now": ("auto", "auto", True),
    "xla": ("auto", "auto", False),
    "before": ("dense", "scan", False),
}


def write_random_int4_target(directory: Path, seed: int = 0) -> KimiConfig:
    """A jaxdd checkpoint of ``SHAPE`` with random weights:
    normal fp32, random INT4 words, scales near 0.002."""
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
    header = CheckpointHeader("target", config.to_hf(), jnp.float32, INT4)
    write_checkpoint(directory, header, groups)
    return config


def bandwidth_probe() -> Callable[[], float]:
    """A function giving the GB/s this host reads 1 GiB at now: the best of three jitted sums,
    XLA matvecs and (where built) dense matvec kernel calls (a peak, as STREAM reports)."""
    data = jnp.ones((2**13, 2**15), jnp.float32)
    vector = jnp.ones((1, 2**13), jnp.float32)
    total, matvec = jax.jit(jnp.sum), jax.jit(jnp.matmul)
    probes = [lambda: total(data), lambda: matvec(vector, data)]
    if cpu_kernels.available():
        kernel = jax.jit(cpu_kernels.dense_matvec)
        probes.append(lambda: kernel(vector, data))
    for probe in probes:  # compile
        probe().block_until_ready()

    def read_gb_s() -> float:
        best = min(
            timed(lambda p=p: p().block_until_ready(), 1)[1] for p in probes for _ in range(3)
        )
        return data.nbytes / best / 1e9

    return read_gb_s


def bytes_per_step(model: KimiTarget, tokens: int, slots: int) -> dict[str, float]:
    """What one target forward of ``tokens`` tokens must read: non-expert
    weights (of the embedding one row per token), the expected distinct experts
    per MoE layer under uniform routing, the KV slots attention reads."""
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


def with_dispatch(model: KimiTarget, dispatch: str, kernel: bool = True) -> jaxdd.Target:
    """The model with every MoE layer forced to ``dispatch`` ("auto":
    the backend's choice), on CPU with or without the CPU kernels."""
    for layer in model.layers:
        if hasattr(layer.mlp, "dispatch"):
            layer.mlp.dispatch = dispatch
    target = jaxdd.Target(model)
    target.backend = Backend("cpu", cpu_kernels=kernel)
    return target


def ar_stepper(target: jaxdd.Target) -> tuple[Callable[[], object], int]:
    """(a function running one AR decode round, cache slots)."""
    decoder = SpeculativeDecoder(target, backend=target.backend)
    batch_round = BatchRound.of(
        decoder, [PROMPT], method="ar", max_new_tokens=512, stop_token_ids=[]
    )
    holder = {"state": batch_round.state}

    def step():
        holder["state"], report = batch_round(holder["state"])
        return report

    return step, batch_round.state.target_cache.slots


def verify_ms(target: jaxdd.Target, repeats: int, slots: int) -> float:
    """Median ms of a target forward of ``VERIFY_TOKENS``
    tokens after the prompt, left uncommitted."""
    holder = {"cache": target.forward(np.array([PROMPT]), cache=target.new_cache(1, slots)).cache}
    ids = np.array([PROMPT[:VERIFY_TOKENS]])

    def verify():
        out = target.forward(ids, cache=holder["cache"], commit=False)
        holder["cache"] = out.cache
        return out.logits

    return median_ms(verify, repeats)


def measure(model: KimiTarget, repeats: int, rounds: int, probe: Callable[[], float]) -> dict:
    """Median ms of the AR step and of the verify forward with the dispatch
    picked now, without the kernels, and first; for the AR step with the kernels,
    ``rounds`` of (``probe()`` GB/s, median ms of ``repeats`` steps)."""
    out = {"ar": {}, "verify": {}}
    for name, (ar_dispatch, verify_dispatch, kernel) in VARIANTS.items():
        jax.clear_caches()
        step, out["slots"] = ar_stepper(with_dispatch(model, ar_dispatch, kernel))
        if name == "now":
            out["rounds"] = [(probe(), median_ms(step, repeats)) for _ in range(rounds)]
            out["ar"][name] = float(np.median([ms for _, ms in out["rounds"]]))
        else:
            out["ar"][name] = median_ms(step, repeats)
        out["verify"][name] = verify_ms(
            with_dispatch(model, verify_dispatch, kernel), repeats, out["slots"]
        )
    with_dispatch(model, "auto")
    return out


def plot(report: dict, path: Path) -> None:
    """Left: the steps against their floors (log); right:
    each AR round's ratio against the bandwidth it met."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (axis, rounds) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    labels = ["AR step", f"verify {VERIFY_TOKENS} tokens"]
    x = np.arange(2)
    labels_of = {
        "floor": "floor",
        "now": "CPU kernels",
        "xla": "XLA only",
        "before": "every expert",
    }
    for offset, (name, label) in zip((-0.3, -0.1, 0.1, 0.3), labels_of.items(), strict=True):
        values = [report[k][f"{name}_ms"] for k in ("ar", "verify")]
        bars = axis.bar(x + offset, values, 0.19, label=label)
        axis.bar_label(bars, fmt="%.1f", fontsize=8)
    axis.set_yscale("log")
    axis.set_xticks(x, labels)
    axis.set_ylabel("ms (log)")
    axis.set_title(f"INT4 MoE, 128 experts top 8, read bandwidth {report['read_gb_s']:.1f} GB/s")
    axis.legend()
    measured = report["ar"]["rounds"]
    rounds.scatter(
        [r["read_gb_s"] for r in measured], [r["over_floor"] for r in measured], label="AR rounds"
    )
    rounds.axhline(2, color="gray", linestyle="--", label="2x the floor")
    rounds.axhline(
        report["ar"]["now_over_floor"],
        color="C1",
        label=f"median {report['ar']['now_over_floor']:.2f}x",
    )
    rounds.set_xlabel("read bandwidth that round (GB/s)")
    rounds.set_ylabel("AR step / floor")
    rounds.set_title("each round against its own floor")
    rounds.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--rounds", type=int, default=9, help="AR rounds alternating with the bandwidth probe"
    )
    args = parser.parse_args()
    probe = bandwidth_probe()
    with tempfile.TemporaryDirectory() as root:
        write_random_int4_target(Path(root) / "int4")
        target = jaxdd.load_target(Path(root) / "int4", dtype="float32")
    times = measure(target.model, args.repeats, args.rounds, probe)
    bandwidth = float(np.median([gb_s for gb_s, _ in times["rounds"]]))
    report = {"shape": SHAPE, "read_gb_s": bandwidth}
    for label, tokens in (("ar", 1), ("verify", VERIFY_TOKENS)):
        needed = bytes_per_step(target.model, tokens, times["slots"])
        gb = (needed["non_expert"] + needed["experts"] + needed["kv"]) / 1e9
        floor_ms = gb / bandwidth * 1e3
        report[label] = {
            "tokens": tokens,
            "bytes": needed,
            "floor_ms": floor_ms,
            **{f"{name}_ms": times[label][name] for name in VARIANTS},
            **{f"{name}_over_floor": times[label][name] / floor_ms for name in VARIANTS},
        }
        if label == "ar":  # each round against the floor at its own bandwidth
            rounds = [
                {"read_gb_s": gb_s, "ms": ms, "over_floor": ms / (gb / gb_s * 1e3)}
                for gb_s, ms in times["rounds"]
            ]
            report[label]["rounds"] = rounds
            report[label]["now_over_floor"] = float(np.median([r["over_floor"] for r in rounds]))
        timings = ", ".join(f"{name} {times[label][name]:.2f} ms" for name in VARIANTS)
        print(
            f"{label}: floor {floor_ms:.2f} ms, {timings}, now "
            f"{report[label]['now_over_floor']:.2f}x the floor"
        )
    write_result(RESULTS / "moe_bandwidth.json", report)
    plot(report, RESULTS / "moe_bandwidth.png")


if __name__ == "__main__":
    main()
