"""What one decode round must read and send per device, the time floor that follows on a named GPU,
and the tokens/s a tau curve predicts: the account behind "decode is bound by the bytes it reads".

A round verifies T tokens (AR 1, DFlash its block, DDTree budget + 1). Each device reads its
shard of every non-expert weight once (the lm_head twice in a speculative round: the drafts'
logits and the verify's), the drafter's shard and the context K/V of its KV heads there, the
routed experts that some token chose (a layer of E experts, top k, sees E (1 - (1 - k/E)^T)
distinct experts for T uniformly routed tokens:
trees change the calculus, the bytes grow with the budget long before the FLOPs matter), and the
KV rows: the MLA latent cache replicated, every device reads all of it; striped, its share, and
it runs the merge's collectives (``jaxdd.planning.cache_layout``). It sends one all-reduce of
[T, hidden] per sharded matmul output (jaxdd sums the routed experts' shares with a psum in both
TP and EP, not an all-to-all). With the round's FLOPs (``jaxdd.planning.roofline``) the floor is
a roofline: max(bytes / memory bandwidth, FLOPs / peak) + collectives over the link, since a
kernel's reads and its arithmetic overlap but each all-reduce waits for the matmul before it and
holds up the next (a floor, not a prediction of overheads).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxdd.cache.draft import kv_dtype
from jaxdd.config import KimiConfig
from jaxdd.models.drafter import DraftAttention
from jaxdd.models.quant import ExpertWeights
from jaxdd.models.target import KimiTarget
from jaxdd.planning.cache_layout import (
    BF16,
    cheapest_merge,
    latent_row_bytes,
    link_seconds,
    merge_costs,
    round_name,
    tokens_read,
)
from jaxdd.planning.hardware import GPUS, Hardware
from jaxdd.planning.roofline import (
    ModelWork,
    RoundSize,
    compute_seconds,
    experts_dtype,
    flops_by_dtype,
    platform_of,
    round_flops,
)
from jaxdd.types import LAYOUTS, CacheLayout, DrafterKV, Method, MoeMode, verified_tokens

# The demo pair's HumanEval tau (CPU, greedy, block
# 8; benchmarks/README.md): tokens per verify round.
DEMO_TAU = {"ar": 1.0, "dflash": 3.00, "ddtree": {4: 2.94, 8: 3.44, 16: 3.77, 32: 4.04, 64: 4.35}}


def distinct_experts(
    tokens: int, top_k: int, experts: int, probabilities: np.ndarray | None = None
) -> float:
    """Expected distinct experts a layer reads for ``tokens`` tokens:
    uniform routing, or per-expert choice probabilities (a measured routing
    histogram, summing to ``top_k``) with tokens routed independently."""
    if probabilities is None:
        return experts * (1 - (1 - top_k / experts) ** tokens)
    p = np.clip(np.asarray(probabilities, np.float64), 0, 1)
    return float(np.sum(1 - (1 - p) ** tokens))


def slowest_device_experts(
    tokens: int, top_k: int, experts: int, devices: int, samples: int = 200
) -> float:
    """EP: the expected distinct local experts of the device that has the most
    (the round waits for it), for uniform routing; sampled with a fixed seed."""
    rng = np.random.default_rng(0)
    most = []
    for _ in range(samples):  # one round's routing at a time: a large batch's fits in memory
        chosen = np.argsort(rng.random((tokens, experts), np.float32), axis=-1)[:, :top_k]
        used = np.zeros((experts,), bool)
        used[chosen.ravel()] = True
        most.append(used.reshape(devices, -1).sum(-1).max())
    return float(np.mean(most))


@dataclasses.dataclass(frozen=True)
class ModelBytes:
    """Per-device bytes of a placed (possibly abstract)
    target and drafter, split the way a round reads them."""

    non_expert: int  # target weights but the routed experts and the embedding
    lm_head: int
    embed_row: int  # one embedding row (each token reads one)
    expert_per_layer: int  # one MoE layer's routed experts, all E of them, on this device
    drafter: int
    moe_layers: int
    dense_layers: int
    drafter_layers: int
    drafter_kv: int  # one context token's drafter K/V here, all layers

    @classmethod
    def of(
        cls,
        target: KimiTarget,
        drafter: nnx.Module | None,
        shard_bytes: Callable[[Any], int],
        drafter_kv: DrafterKV = "model",
    ) -> ModelBytes:
        """From modules whose parameters are (abstract) arrays (no drafter: none of its bytes);
        ``shard_bytes(array)`` gives one device's bytes; the drafter's K/V stored as
        ``drafter_kv`` says."""
        params = lambda module: (
            jax.tree.leaves(nnx.state(module, nnx.Param)) if module is not None else []
        )
        experts = sum(
            shard_bytes(getattr(m, name).get_value())
            for _, m in nnx.iter_modules(target)
            if isinstance(m, ExpertWeights)
            for name in m.PIECES
        )
        embed = target.embed.get_value()
        c = target.config
        moe_layers = c.num_hidden_layers - c.first_k_dense_replace
        # the K/V projections' output width here, in the cache's dtype
        modules = nnx.iter_modules(drafter) if drafter is not None else []
        attention = [m for _, m in modules if isinstance(m, DraftAttention)]
        weights = [m.k_proj.get_value() for m in attention]
        stored = [kv_dtype(drafter_kv, w.dtype).itemsize / w.dtype.itemsize for w in weights]
        projections = sum(shard_bytes(w) * s for w, s in zip(weights, stored, strict=True)) * 2
        return cls(
            non_expert=sum(shard_bytes(x) for x in params(target)) - experts - shard_bytes(embed),
            lm_head=shard_bytes(target.lm_head.get_value()),
            embed_row=c.hidden_size * embed.dtype.itemsize,
            expert_per_layer=experts // max(moe_layers, 1),
            drafter=sum(shard_bytes(x) for x in params(drafter)),
            moe_layers=moe_layers,
            dense_layers=c.first_k_dense_replace,
            drafter_layers=len(attention),
            drafter_kv=int(projections) // drafter.config.hidden_size if attention else 0,
        )


@dataclasses.dataclass(frozen=True)
class PairAccount:
    """What a round's floor is counted from: the target's config, the pair's bytes on a device
    and, for its FLOPs too, the work its weights do there."""

    config: KimiConfig
    model: ModelBytes
    work: ModelWork | None = None


@dataclasses.dataclass(frozen=True)
class Spread:
    """How a round spreads over the devices: their count, the MoE split and the latent cache's
    layout (``cache_layout.LAYOUTS``)."""

    devices: int
    moe: MoeMode
    layout: CacheLayout = "replicated"


def round_traffic(size: RoundSize, pair: PairAccount, spread: Spread) -> dict[str, Any]:
    """Bytes one device reads, and sends in all-reduces, in a round of ``size`` (AR drafts no
    token); striped adds the merge's ``merges`` (bytes sent and collectives per scheme). With the
    pair's ``work``, the FLOPs it runs too (``flops``, by part and per platform by dtype)."""
    config, model, work = pair.config, pair.model, pair.work
    devices, moe, layout = spread.devices, spread.moe, spread.layout
    context, draft_tokens, batch = size.context, size.draft_tokens, size.batch
    e = config.n_routed_experts
    k = config.num_experts_per_tok
    # the weights are read once for all rows' tokens, the cache once per row
    verified = size.verified
    # one expert's bytes here
    per_expert = model.expert_per_layer / (e if moe == "tp" else e / devices)
    if moe == "ep" and devices > 1:
        local = slowest_device_experts(verified, k, e, devices)
    else:
        local = distinct_experts(verified, k, e)
    latent = batch * tokens_read(context, devices, layout) * latent_row_bytes(config)
    speculative = draft_tokens > 0
    reads = {
        "weights": model.non_expert + verified * model.embed_row,
        "experts": model.moe_layers * local * per_expert,
        "kv": latent,
        "drafter": (model.drafter + model.lm_head) if speculative else 0,
        "drafter_kv": batch * context * model.drafter_kv if speculative else 0,
    }
    # All-reduces of [T, hidden]: attention and MLP outputs of every layer,
    # the routed psum and the shared expert of MoE layers, the embedding's
    # vocab-parallel psum; the drafter's layers over its block.
    target_allreduces = 2 * model.dense_layers + 3 * model.moe_layers + 1
    drafter_allreduces = 2 * model.drafter_layers if speculative else 0
    message = config.hidden_size * BF16
    ring = 2 * (devices - 1) / devices if devices > 1 else 0.0
    drafted = draft_tokens * batch
    sent = ring * message * (target_allreduces * verified + drafter_allreduces * drafted)
    count = (target_allreduces + drafter_allreduces) if devices > 1 else 0
    traffic = {
        **reads,
        "read_total": sum(reads.values()),
        "allreduce_bytes": sent,
        "allreduces": count,
        "experts_read": local,
    }
    if layout == "striped":
        traffic["merges"] = merge_costs(config, verified, devices)
    if work is not None:
        parts = round_flops(size, config, work, devices, layout)
        dtype = lambda gpu: experts_dtype(verified, config, work, devices, moe, gpu)
        traffic["flops"] = sum(parts.values())
        traffic["flops_by_part"] = parts
        traffic["flops_by_dtype"] = {
            platform: flops_by_dtype(parts, dtype(platform == "gpu")) for platform in ("gpu", "tpu")
        }
    return traffic


@dataclasses.dataclass(frozen=True)
class PlannedRound:
    """A round a plan weighs: its method, the drafter's block (AR drafts none), DDTree's budget,
    its rows and the context tokens of each."""

    method: Method
    block: int
    budget: int | None
    batch: int
    context: int

    @property
    def name(self) -> str:
        return round_name(self.method, self.budget, self.batch)

    @property
    def needed(self) -> int:
        """The context tokens its rows hold together."""
        return self.batch * self.context

    @property
    def size(self) -> RoundSize:
        """What it runs: AR verifies one token and drafts none."""
        block = 1 if self.method == "ar" else self.block
        tokens = verified_tokens(self.method, block, self.budget)
        draft = 0 if self.method == "ar" else block
        return RoundSize(tokens, self.context, draft, self.batch)

    def traffic(self, pair: PairAccount, spread: Spread) -> dict[str, Any]:
        """Its ``round_traffic`` (its FLOPs with the pair's ``work``)."""
        return round_traffic(self.size, pair, spread)

    def floors(
        self, pair: PairAccount, devices: int, moe: MoeMode, hardware: Hardware | None
    ) -> dict[str, float]:
        """Its floor (seconds) in each layout on ``hardware``, a roofline with the pair's
        ``work``; none without a hardware model."""
        if hardware is None:
            return {}
        traffic = lambda layout: self.traffic(pair, Spread(devices, moe, layout))
        return {layout: floor_seconds(traffic(layout), hardware)["round_s"] for layout in LAYOUTS}


def floor_seconds(traffic: Mapping[str, Any], hardware: Hardware) -> dict[str, Any]:
    """Memory, compute and link time of a round on ``hardware`` and which of memory and compute
    bounds it (``bound``; a round without FLOPs counted: memory); a striped round's link time
    holds its merge, the scheme the link model finds cheaper (``merge``)."""
    memory = traffic["read_total"] / hardware.bandwidth
    by_dtype = traffic.get("flops_by_dtype", {}).get(platform_of(hardware), {})
    compute = compute_seconds(by_dtype, hardware)
    link = link_seconds(traffic["allreduce_bytes"], traffic["allreduces"], hardware)
    times = {
        "memory_s": memory,
        "compute_s": compute,
        "bound": "compute" if compute > memory else "memory",
    }
    merge = cheapest_merge(traffic.get("merges", {}), hardware)
    if merge is None:
        return times | {"link_s": link, "round_s": max(memory, compute) + link}
    cost = traffic["merges"][merge]
    merge_s = link_seconds(cost["bytes"], cost["collectives"], hardware)
    return times | {
        "link_s": link + merge_s,
        "round_s": max(memory, compute) + link + merge_s,
        "merge": merge,
        "merge_s": merge_s,
    }


def traffic_table(
    pair: PairAccount,
    spread: Spread,
    context: int,
    block: int,
    budgets: tuple[int, ...] = (4, 8, 16, 32, 64),
    tau: Mapping = DEMO_TAU,
    batch: int = 1,
) -> list[dict]:
    """One row per round shape (AR, DFlash at ``block``, DDTree at each budget) of ``batch``
    rows: what a device reads and sends (and with the pair's ``work`` the FLOPs it runs), and
    per named GPU the floor per round and the tokens/s (all rows') ``tau`` predicts there."""
    shapes = [("ar", PlannedRound("ar", block, None, batch, context), tau["ar"])]
    shapes += [("dflash", PlannedRound("dflash", block, None, batch, context), tau["dflash"])]
    shapes += [
        (f"ddtree {b}", PlannedRound("ddtree", block, b, batch, context), tau["ddtree"][b])
        for b in budgets
        if b in tau["ddtree"]
    ]
    rows = []
    for name, planned, expected in shapes:
        traffic = planned.traffic(pair, spread)
        tokens = planned.size.tokens
        row = {"round": name, "tokens": tokens, "tau": expected, **traffic, "targets": {}}
        for key, hardware in GPUS.items():
            floor = floor_seconds(traffic, hardware)
            row["targets"][key] = floor | {"tokens_per_s": batch * expected / floor["round_s"]}
        rows.append(row)
    return rows


def fastest_rounds(rows: list[dict]) -> dict[str, str]:
    """Per named GPU, the round of the table with the most tokens/s at its floor."""
    speed = lambda gpu: {row["round"]: row["targets"][gpu]["tokens_per_s"] for row in rows}
    return {gpu: max(speed(gpu).items(), key=lambda item: item[1])[0] for gpu in GPUS}


def sent_bytes(traffic: Mapping[str, Any], merge: str | None) -> float:
    """What a device sends in a round: its all-reduces, and the ``merge`` scheme's bytes
    (a striped round's, as ``floor_seconds`` picks it; None: no merge)."""
    merged = traffic["merges"][merge]["bytes"] if merge is not None else 0.0
    return traffic["allreduce_bytes"] + merged


def format_table(rows: list[dict]) -> str:
    """The table as text: GB read, MB sent per device (the all-reduces and a striped round's
    merge, as the link time counts them) and TFLOP run, then per GPU the floor (c: compute
    bound) and tokens/s."""
    names = list(GPUS)
    head = f"{'round':<11} {'tau':>5} {'read GB':>8} {'experts':>8} {'sent MB':>8} {'TFLOP':>6}"
    head += "".join(f" | {GPUS[n].name:>27}" for n in names)
    merged = any(row.get("merges") for row in rows)
    sent_head = "(all-reduces + merge)" if merged else "(all-reduces)"
    lines = [
        head,
        f"{sent_head:>51}" + "".join(f" | {'ms (link ms)    tokens/s':>27}" for _ in names),
    ]
    for row in rows:
        sent = {sent_bytes(row, row["targets"][n].get("merge")) / 1e6 for n in names}
        shown = f"{min(sent):.2f}" if len(sent) == 1 else f"{min(sent):.0f}-{max(sent):.0f}"
        line = f"{row['round']:<11} {row['tau']:>5.2f} {row['read_total'] / 1e9:>8.2f} "
        line += f"{row['experts_read']:>8.1f} {shown:>8} {row.get('flops', 0) / 1e12:>6.2f}"
        for n in names:
            t = row["targets"][n]
            bound = "c" if t["bound"] == "compute" else " "
            line += f" | {t['round_s'] * 1e3:>6.2f}{bound} ({t['link_s'] * 1e3:.2f}) "
            line += f"{t['tokens_per_s']:>9.0f}"
        lines.append(line)
    return "\n".join(lines)
