"""The routed experts of a Kimi / DeepSeek-V3 MoE layer: noaux_tc routing, the experts' weights
and their placement over a mesh; the six exact dispatches are ``jaxdd.models.expert_dispatch``.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from jaxdd.config import KimiConfig
from jaxdd.models.expert_dispatch import (
    all_experts,
    gathered_experts,
    gathered_local_pairs,
    grouped_experts,
    int4_kernel,
    pair_experts,
    scanned_experts,
    skipping_experts,
    tiled_experts,
)
from jaxdd.models.layers import MLP, linear, param
from jaxdd.models.quant import DenseExperts, ExpertFormat, ExpertWeights, expert_weights
from jaxdd.runtime.backend import Backend
from jaxdd.runtime.sharding import AXIS, Placeable, partition_spec
from jaxdd.types import Dispatch, MoeMode


def expert_specs(
    projections: tuple[ExpertWeights, ...], mesh: Mesh, mode: MoeMode
) -> list[PartitionSpec] | None:
    """One spec per routed-expert projection (gate, up, down), shared
    by all its stored pieces; None when the mesh cannot split the same
    logical axis of all three (then the experts stay replicated)."""
    specs = [partition_spec(p.shape, p.axes, mesh, mode, p.units) for p in projections]
    split = [
        {axis for axis, s in zip(p.axes, spec, strict=True) if s}
        for p, spec in zip(projections, specs, strict=True)
    ]
    return specs if split[0] and all(s == split[0] for s in split) else None


class Router(nnx.Module):
    """noaux_tc routing: sigmoid scores; the correction
    bias picks experts but does not weight them."""

    def __init__(self, config: KimiConfig, dtype: str, rngs: nnx.Rngs):
        self.config = config
        e = config.n_routed_experts
        # bf16 where the checkpoint stores it so (Kimi,
        # DeepSeek-V3): HF's fp32 copy holds the same values.
        self.weight = param(rngs, (config.hidden_size, e), jnp.dtype(dtype), ("embed", None))
        self.bias = nnx.Param(jnp.zeros((e,), jnp.float32), logical_axes=(None,))

    def __call__(self, x: jax.Array, backend: Backend | None = None) -> tuple[jax.Array, jax.Array]:
        """x [N, D] -> (weights [N, k] fp32, expert ids [N, k] int32)."""
        c = self.config
        scores = jax.nn.sigmoid(self._logits(x.astype(jnp.float32), backend))
        choice = scores + self.bias[...]
        if c.n_group > 1:
            n = x.shape[0]
            per_group = c.n_routed_experts // c.n_group
            grouped = choice.reshape(n, c.n_group, per_group)
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
            keep = (
                jax.nn.one_hot(jax.lax.top_k(group_scores, c.topk_group)[1], c.n_group).sum(-2) > 0
            )
            choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(n, c.n_routed_experts)
        experts = jax.lax.top_k(choice, c.num_experts_per_tok)[1]
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        return weights * c.routed_scaling_factor, experts

    def _logits(self, x: jax.Array, backend: Backend | None) -> jax.Array:
        """fp32 x [N, D] @ the gate, with fp32 products and sums. A bf16 gate off CPU is multiplied
        as stored (for a matmul of mixed types XLA:GPU writes the gate out in fp32 first): x as
        three bf16 parts through one bf16 matmul, whose products are exact in fp32. The parts sum to
        x exactly for 2**-103 <= |x| (each holds 8 of fp32's 24 significant bits; below, the last
        part may be subnormal, which XLA flushes); the sums run in another order than one fp32
        matmul's."""
        weight = self.weight[...]
        if weight.dtype == jnp.float32 or backend is None or backend.platform == "cpu":
            return linear(x, weight, backend)
        high = _bf16_head(x)
        middle = _bf16_head(x - high)
        low = x - high - middle
        parts = jnp.stack([high, middle, low]).astype(jnp.bfloat16)
        parts = jnp.einsum("pnd,de->pne", parts, weight, preferred_element_type=jnp.float32)
        return parts[0] + parts[1] + parts[2]


def _bf16_head(x: jax.Array) -> jax.Array:
    """fp32 x cut to its leading 8 significant bits (a bf16 value, still
    fp32), by masking its bits: converting to bf16 and back is a round
    trip that XLA:GPU removes, which would make ``x - head`` zero."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


class MoE(nnx.Module, Placeable):
    """Routed SwiGLU experts plus unweighted shared experts.

    Expert weights may be stored quantized (``jaxdd.models.quant.ExpertFormat``) and are
    dequantized to the model dtype inside the jitted forward. Dequantizing a whole expert stack
    at once would need its dense copy in memory (and XLA may hoist those copies for all layers to
    the start of the step), so beyond small problems quantized experts go through ``scan``: one
    expert dequantized at a time, right before its matmuls. On CPU, INT4 experts of few pairs go
    through a C++ kernel that dequantizes in registers (``jaxdd.runtime.cpu_kernels``), on TPU
    through a Mosaic kernel that fetches the chosen experts' blocks and dequantizes them in VMEM.
    """

    def __init__(self, config: KimiConfig, dtype: jnp.dtype, experts: ExpertFormat, rngs: nnx.Rngs):
        c = config
        e = c.n_routed_experts
        d = c.hidden_size
        f = c.moe_intermediate_size
        self.config = c
        self.dispatch: Literal["auto"] | Dispatch = "auto"  # "auto": as the backend chooses
        # (mesh, "tp" | "ep") once placed by ``jaxdd.runtime.sharding.shard_module``
        self.placement = None
        self.router = Router(c, experts.router, rngs)
        self.gate = expert_weights(
            experts, rngs, (e, d, f), dtype, ("experts", "embed", "expert_mlp")
        )
        self.up = expert_weights(
            experts, rngs, (e, d, f), dtype, ("experts", "embed", "expert_mlp")
        )
        self.down = expert_weights(
            experts, rngs, (e, f, d), dtype, ("experts", "expert_mlp", "embed")
        )
        self.shared = MLP(d, f * c.n_shared_experts, dtype, rngs) if c.n_shared_experts else None

    def __call__(self, x: jax.Array, backend: Backend) -> jax.Array:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts = self.router(x, backend)
        if self.placement is None:
            pieces = [p.stored() for p in (self.gate, self.up, self.down)]
            routed = self._routed(x, weights, experts, pieces, backend)
        else:
            routed = self._sharded_routed(x, weights, experts, backend)
        routed = routed.astype(x.dtype)
        if self.shared is not None:
            routed = routed + self.shared(x, backend)
        return routed.reshape(shape)

    def joint_specs(self, mesh: Mesh, mode: MoeMode) -> dict[tuple[str, ...], PartitionSpec]:
        """Every stored piece of gate, up and down splits as
        its projection does, all three alike or not at all."""
        specs = expert_specs((self.gate, self.up, self.down), mesh, mode) or [PartitionSpec()] * 3
        projections = {"gate": self.gate, "up": self.up, "down": self.down}
        return {
            (name, piece): spec
            for (name, projection), spec in zip(projections.items(), specs, strict=True)
            for piece in projection.PIECES
        }

    def accepts(self, mesh: Mesh, mode: MoeMode) -> bool:
        """Replicated experts (the mesh cannot split them) keep the plain dispatch."""
        return expert_specs((self.gate, self.up, self.down), mesh, mode) is not None

    def dispatch_for(self, tokens: int, local_experts: int, backend: Backend) -> Dispatch:
        """The dispatch this layer runs ``tokens`` tokens
        with, over the ``local_experts`` a device holds."""
        if self.dispatch != "auto":
            return self.dispatch
        c = self.config
        quantized = not isinstance(self.gate, DenseExperts)
        kernel = (
            int4_kernel((self.gate, self.up, self.down), backend, self._unplaced(backend))
            is not None
        )
        d = c.hidden_size
        f = c.moe_intermediate_size
        top_k = c.num_experts_per_tok
        return backend.moe_dispatch(tokens, top_k, local_experts, d, f, quantized, kernel)

    def _routed(
        self, x, weights, experts, pieces: list[tuple[jax.Array, ...]], backend: Backend, local=None
    ) -> jax.Array:
        """fp32 [N, D]: the weighted expert outputs, for experts [N, k] indexing the stored
        ``pieces`` of gate, up and down ([E, ...] each: all experts, or one device's). ``local``:
        under EP, (the pairs routed to this device's experts [N, k], how many to gather at most)."""
        projections = (self.gate, self.up, self.down)
        dispatch = self.dispatch_for(experts.shape[0], pieces[0][0].shape[0], backend)
        if dispatch == "gathered":
            through = pair_experts(projections, pieces, backend, self._unplaced(backend))
            if local is not None:
                return gathered_local_pairs(x, weights, experts, *local, through)
            return gathered_experts(x, weights, experts, through)
        if dispatch == "scan":
            return scanned_experts(x, weights, experts, projections, pieces)
        if dispatch == "skipping":
            return skipping_experts(x, weights, experts, projections, pieces)
        if dispatch == "tiled":
            return tiled_experts(x, weights, experts, projections, pieces)
        dense = [p.dequantize(*stored) for p, stored in zip(projections, pieces, strict=True)]
        return (all_experts if dispatch == "dense" else grouped_experts)(
            x, weights, experts, *dense
        )

    def _unplaced(self, backend: Backend) -> bool:
        """Whether the experts lie on several devices outside
        ``shard_map`` (no kernel that is not partitioned)."""
        return self.placement is None and backend.devices > 1

    def _sharded_routed(
        self, x: jax.Array, weights: jax.Array, experts: jax.Array, backend: Backend
    ) -> jax.Array:
        """The routed experts under ``shard_map`` (see ``jaxdd.runtime.sharding``):
        each device holds a slice of every expert (tp) or whole experts (ep), sees
        every (token, route) pair, computes its share and the shares are summed
        across devices: no ragged all-to-all, which XLA:CPU lacks."""
        mesh, mode = self.placement
        projections = (self.gate, self.up, self.down)
        specs = expert_specs(projections, mesh, mode)
        pieces = [p.stored() for p in projections]
        replicated = jax.sharding.PartitionSpec()
        split_experts = specs[0][0] == AXIS  # ep: whole experts per device
        local_experts = self.config.n_routed_experts // (mesh.shape[AXIS] if split_experts else 1)
        # Pairs a device gathers at most under EP: twice
        # its even share, and one (past it, every pair is).
        capacity = 2 * -(-experts.size // mesh.shape[AXIS]) + 1

        def local(x, weights, experts, gate_pieces, up_pieces, down_pieces):
            first = jax.lax.axis_index(AXIS) * local_experts if split_experts else 0
            ids = experts - first
            mine = (ids >= 0) & (ids < local_experts)
            # Routes to other devices' experts get weight
            # 0 (and any local id, so shapes stay static).
            ids = jnp.where(mine, ids, 0)
            weights = jnp.where(mine, weights, 0.0)
            local_pieces = [gate_pieces, up_pieces, down_pieces]
            pairs = (mine, capacity) if split_experts and capacity < experts.size else None
            return jax.lax.psum(self._routed(x, weights, ids, local_pieces, backend, pairs), AXIS)

        in_specs = (
            replicated,
            replicated,
            replicated,
            *[(spec,) * len(p) for spec, p in zip(specs, pieces, strict=True)],
        )
        sharded = jax.shard_map(
            local, mesh=mesh, in_specs=in_specs, out_specs=replicated, check_vma=False
        )
        return sharded(x, weights, experts, *pieces)
