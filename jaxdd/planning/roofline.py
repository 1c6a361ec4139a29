"""The compute side of a round's floor: the FLOPs one device runs in a round, by the dtype its
matrix units run them in, and the seconds they take at the hardware's peak dense throughput.

A round verifying T tokens in each of B rows at C tokens of context runs, per device:
- the target's matrices on its B T tokens, 2 multiply-add FLOPs per weight element stored here
  (replicated ones, like MLA's down-projections, on every device), the lm_head included;
- the router's gate three times over: off CPU its fp32 input is split into three bf16 parts
  (``jaxdd.models.moe.Router``);
- each token's top-k routed experts, 3 x hidden x moe_intermediate each, split over the
  devices in TP and EP alike (the mean device under EP: routing imbalance is left out);
- absorbed MLA attention: 2 x heads x (C + T) x (kv_lora_rank + qk_rope_head_dim +
  kv_lora_rank) per token and layer, scores over latent and rope rows and the latent values,
  for the heads this device holds (all of them over its own pages when striped; the tree's tail
  is computed dense, its mask saves nothing);
- speculative rounds: the drafter's matrices over its block, its K/V projections again over
  the block of context features it injects, the lm_head over the block's drafts, and its
  attention over its context and block.

Everything multiplies in bf16 (the models' dtype; INT4 and FP8 experts are dequantized to bf16
before XLA's dot, and on TPU inside the Mosaic kernel), except INT4 experts on GPUs where the
round gathers them: the Triton kernel (``pallas_kernels.int4_experts``) multiplies in fp32 on the
CUDA cores. Elementwise work (norms, rope, softmax, dequantization) is left out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx

from jaxdd.config import KimiConfig
from jaxdd.models.attention import MLAttention
from jaxdd.models.drafter import DraftAttention
from jaxdd.models.moe import Router
from jaxdd.models.quant import ExpertWeights, Int4Experts
from jaxdd.models.target import KimiTarget
from jaxdd.planning.cache_layout import tokens_read
from jaxdd.planning.hardware import Gpu, Hardware
from jaxdd.runtime.backend import Backend
from jaxdd.types import CacheLayout
from pallas_kernels import int4_experts

BF16 = "bf16"
FP32 = "fp32"
ROUTER_PASSES = 3  # the router's bf16 parts of its fp32 input


@dataclasses.dataclass(frozen=True)
class ModelWork:
    """Per-device weight elements of a placed (possibly abstract) target and drafter, split the
    way a round multiplies by them, and the attention heads each device computes."""

    target_matmul: int  # the target's matrices but the routed experts, router and embedding
    router: int  # one MoE layer's gate
    heads: int  # target attention heads here
    drafter_matmul: int  # every drafter matrix, its fc included
    drafter_kv_proj: int  # its K and V projections, all layers
    drafter_heads: int
    drafter_head_dim: int
    drafter_layers: int
    lm_head: int
    int4_gathered_kernel: bool  # INT4 experts in a group size the GPU's gathered kernel takes

    @classmethod
    def of(
        cls,
        target: KimiTarget,
        drafter: nnx.Module | None,
        shard_bytes: Callable[[Any], int],
    ) -> ModelWork:
        """From modules whose parameters are (abstract) arrays placed on their devices;
        ``shard_bytes(array)`` gives one device's bytes (no drafter: none of its work)."""
        here = lambda x: shard_bytes(x) // x.dtype.itemsize
        matrices = lambda module: sum(
            here(x) for x in jax.tree.leaves(nnx.state(module, nnx.Param)) if x.ndim >= 2
        )
        modules = [m for _, m in nnx.iter_modules(target)]
        experts = [m for m in modules if isinstance(m, ExpertWeights)]
        routed = sum(here(getattr(m, name).get_value()) for m in experts for name in m.PIECES)
        gates = [m.weight.get_value() for m in modules if isinstance(m, Router)]
        c = target.config
        k_up = next(m.k_up.get_value() for m in modules if isinstance(m, MLAttention))
        attention = []
        if drafter is not None:
            attention = [m for _, m in nnx.iter_modules(drafter) if isinstance(m, DraftAttention)]
        projections = [m.k_proj.get_value() for m in attention]
        projections += [m.v_proj.get_value() for m in attention]
        q = attention[0].q_proj.get_value() if attention else None
        head_dim = attention[0].config.head_dim if attention else 0
        int4 = bool(experts) and all(isinstance(m, Int4Experts) for m in experts)
        groups = {m.group for m in experts} if int4 else set()
        router = here(gates[0]) if gates else 0
        return cls(
            target_matmul=matrices(target)
            - routed
            - router * len(gates)
            - here(target.embed.get_value()),
            router=router,
            heads=here(k_up) // (c.kv_lora_rank * c.qk_nope_head_dim),
            drafter_matmul=matrices(drafter) if drafter is not None else 0,
            drafter_kv_proj=sum(here(x) for x in projections),
            drafter_heads=here(q) // (q.shape[0] * head_dim) if q is not None else 0,
            drafter_head_dim=head_dim,
            drafter_layers=len(attention),
            lm_head=here(target.lm_head.get_value()),
            int4_gathered_kernel=len(groups) == 1 and int4_experts.supports(min(groups)),
        )


@dataclasses.dataclass(frozen=True)
class RoundSize:
    """What a round runs: ``tokens`` verified in each of ``batch`` rows at ``context`` tokens of
    KV each, after drafting ``draft_tokens`` per row (the drafter's block; 0: AR)."""

    tokens: int
    context: int
    draft_tokens: int = 0
    batch: int = 1

    @property
    def verified(self) -> int:
        """Tokens verified in all rows."""
        return self.tokens * self.batch


def round_flops(
    size: RoundSize,
    config: KimiConfig,
    work: ModelWork,
    devices: int,
    layout: CacheLayout = "replicated",
) -> dict[str, float]:
    """FLOPs one device runs in a round of ``size``, by part. Striped, the busiest device: all
    heads over its pages, and the tree's tail."""
    tokens, context, draft_tokens, batch = size.tokens, size.context, size.draft_tokens, size.batch
    verified = size.verified
    c = config
    moe_layers = c.num_hidden_layers - c.first_k_dense_replace
    row = 2 * c.kv_lora_rank + c.qk_rope_head_dim  # latent scores, rope scores, latent values
    if layout == "striped":
        heads, keys = c.num_attention_heads, tokens_read(context, devices, layout) + tokens
    else:
        heads, keys = work.heads, context + tokens
    pair = 3 * c.hidden_size * c.moe_intermediate_size  # gate, up and down of one expert
    flops = {
        "attention": 2 * verified * heads * keys * row * c.num_hidden_layers,
        "matmuls": 2 * verified * (work.target_matmul + ROUTER_PASSES * work.router * moe_layers),
        "experts": 2 * verified * c.num_experts_per_tok * pair * moe_layers / devices,
        "drafter": 0,
        "drafter_attention": 0,
    }
    if draft_tokens:
        drafted = draft_tokens * batch
        # K/V of its context features; the drafts' logits through the lm_head
        injected = drafted * work.drafter_kv_proj
        logits = (draft_tokens - 1) * batch * work.lm_head
        flops["drafter"] = 2 * (drafted * work.drafter_matmul + injected + logits)
        # scores and values
        width = 2 * work.drafter_heads * work.drafter_head_dim * work.drafter_layers
        flops["drafter_attention"] = 2 * drafted * (context + draft_tokens) * width
    return flops


def experts_dtype(
    tokens: int, config: KimiConfig, work: ModelWork, devices: int, moe: str, gpu: bool
) -> str:
    """The dtype the routed experts multiply in for ``tokens`` tokens: fp32 where a GPU gathers
    INT4 experts through its kernel (the dispatch ``Backend.moe_dispatch`` picks), else bf16."""
    if not (gpu and work.int4_gathered_kernel):
        return BF16
    c = config
    local = c.n_routed_experts // devices if moe == "ep" else c.n_routed_experts
    shape = (c.num_experts_per_tok, local, c.hidden_size, c.moe_intermediate_size)
    dispatch = Backend("gpu").moe_dispatch(tokens, *shape, quantized=True, kernel=True)
    return FP32 if dispatch == "gathered" else BF16


def flops_by_dtype(flops: Mapping[str, float], experts: str) -> dict[str, float]:
    """The round's FLOPs per dtype, the routed experts' in ``experts``."""
    by_dtype = {BF16: sum(n for part, n in flops.items() if part != "experts")}
    by_dtype[experts] = by_dtype.get(experts, 0.0) + flops["experts"]
    return by_dtype


def compute_seconds(by_dtype: Mapping[str, float], hardware: Hardware) -> float:
    """The FLOPs at the hardware's peak dense throughput in each dtype."""
    return sum(n / hardware.peak_flops[dtype] for dtype, n in by_dtype.items() if n)


def platform_of(hardware: Hardware) -> str:
    """``gpu`` or ``tpu``: the key of a round's ``flops_by_dtype``."""
    return "gpu" if isinstance(hardware, Gpu) else "tpu"
