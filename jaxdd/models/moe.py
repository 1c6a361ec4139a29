"""The routed experts of a Kimi / DeepSeek-V3 MoE layer:
noaux_tc routing and six exact expert dispatches.

Dispatches (``Backend.moe_dispatch`` picks one per platform and token count; ``MoE.dispatch`` can
force one): ``gathered`` gives each (token, slot) pair its own expert's weights, gathered from
the stored pieces (and dequantized after the gather; INT4 on CPU and GPU: in registers by
``jaxdd.runtime.cpu_kernels`` and ``pallas_kernels.int4_experts``, on TPU: in VMEM by
``pallas_kernels.int4_experts_tpu``), so only the chosen experts are read; ``grouped`` sorts the
(token, slot) pairs by expert and runs grouped matmuls (``ragged_dot``), the scalable form for
dense weights; ``dense`` runs every expert on every token and weights the outputs by the combine
weights (zero for unchosen experts); ``scan`` does the same one expert at a time; ``skipping``
too, but skips the experts no token chose; ``tiled`` sorts the pairs by expert into tiles of one
expert each and runs the used tiles one at a time. All return fp32 [N, D]; the caller casts back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from jaxdd.config import KimiConfig
from jaxdd.models.layers import MLP, linear, param
from jaxdd.models.quant import (
    DenseExperts,
    ExpertFormat,
    ExpertWeights,
    Int4Experts,
    expert_weights,
)
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
            _int4_kernel((self.gate, self.up, self.down), backend, self._unplaced(backend))
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
            through = _pair_experts(projections, pieces, backend, self._unplaced(backend))
            if local is not None:
                return _gathered_local_pairs(x, weights, experts, *local, through)
            return _gathered_experts(x, weights, experts, through)
        if dispatch == "scan":
            return _scanned_experts(x, weights, experts, projections, pieces)
        if dispatch == "skipping":
            return _skipping_experts(x, weights, experts, projections, pieces)
        if dispatch == "tiled":
            return _tiled_experts(x, weights, experts, projections, pieces)
        dense = [p.dequantize(*stored) for p, stored in zip(projections, pieces, strict=True)]
        return (_all_experts if dispatch == "dense" else _grouped_experts)(
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


def _grouped_experts(x, weights, experts, gate, up, down) -> jax.Array:
    """(token, slot) pairs sorted by expert through
    grouped matmuls (``ragged_dot``); fp32 [N, D]."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    rows = x[order // k]
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
    hidden = jax.nn.silu(jax.lax.ragged_dot(rows, gate, sizes)) * jax.lax.ragged_dot(
        rows, up, sizes
    )
    out = jax.lax.ragged_dot(hidden, down, sizes)
    out = jnp.zeros_like(out).at[order].set(out).reshape(n, k, -1)
    # Moonshot's moe_infer: expert outputs summed with
    # their weights in fp32 (cast back by the caller).
    return jnp.einsum("nkd,nk->nd", out.astype(jnp.float32), weights)


def _pair_experts(
    projections, pieces, backend: Backend, unplaced: bool = False
) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """(rows [P, D], chosen [P]) -> [P, D]: each row through its own expert. INT4 experts
    go through the backend's matvec kernel where it has one (CPU and GPU: unpacked in
    registers as the words are read; TPU: the chosen experts' blocks fetched and
    dequantized in VMEM); otherwise the chosen experts' pieces are gathered and then
    dequantized. ``unplaced``: the pieces lie on several devices outside ``shard_map``."""
    kernel = _int4_kernel(projections, backend, unplaced)
    if kernel is None:
        # so XLA:GPU and XLA:TPU fuse the gather, for groups their kernels lack
        shifts = backend.platform != "cpu"
        return functools.partial(
            _gathered_pairs, projections=projections, pieces=pieces, shifts=shifts
        )
    gate, up, down = pieces  # (packed, scale) each

    def through(rows: jax.Array, chosen: jax.Array) -> jax.Array:
        hidden = jax.nn.silu(kernel(rows, *gate, chosen)) * kernel(rows, *up, chosen)
        return kernel(hidden, *down, chosen)

    return through


def _int4_kernel(
    projections, backend: Backend, unplaced: bool = False
) -> Callable[..., jax.Array] | None:
    """The backend's INT4 matvec kernel if it has one (for pieces ``unplaced`` or not: see
    ``Backend.int4_matvec``) and all three projections are INT4 in one group size it takes."""
    groups = {p.group if isinstance(p, Int4Experts) else None for p in projections}
    if len(groups) == 1 and None not in groups:
        return backend.int4_matvec(groups.pop(), unplaced)
    return None


def _gathered_experts(x, weights, experts, through) -> jax.Array:
    """Each (token, slot) pair through its own expert (``through``, from
    ``_pair_experts``: the chosen experts' stored bytes read once per pair);
    fp32 [N, D]. For few pairs: an expert chosen by two tokens is read twice."""
    n, k = experts.shape
    out = through(jnp.repeat(x, k, axis=0), experts.reshape(-1))  # pair p: token p // k
    return jnp.einsum("nkd,nk->nd", out.reshape(n, k, -1).astype(jnp.float32), weights)


def _gathered_local_pairs(x, weights, experts, mine, capacity: int, through) -> jax.Array:
    """``_gathered_experts`` on one device under EP, where only the pairs routed to its
    own experts (``mine``; the others carry weight 0) count: those are moved to the
    front and the first ``capacity`` gathered, so a device reads about pairs / devices
    experts instead of one per pair. When more of its pairs are local than that, every
    pair is gathered instead (lax.cond runs one branch): exact either way."""
    n, k = experts.shape
    local = mine.reshape(-1)
    order = jnp.argsort(~local, stable=True)[:capacity]  # the local pairs first, in pair order
    tokens = order // k

    def compacted() -> jax.Array:
        out = through(x[tokens], experts.reshape(-1)[order])
        # 0 past the local pairs
        weighted = out.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
        return jnp.zeros((n, out.shape[-1]), jnp.float32).at[tokens].add(weighted)

    def every_pair() -> jax.Array:
        return _gathered_experts(x, weights, experts, through)

    return jax.lax.cond(local.sum() <= capacity, compacted, every_pair)


def _gathered_pairs(rows, chosen, projections, pieces, shifts: bool = False) -> jax.Array:
    """rows [P, D] through experts ``chosen`` [P], their pieces gathered and then dequantized:
    [P, D] (``shifts``: INT4 unpacked by shifts, ``jaxdd.models.quant.unpack_int4``)."""

    def dequantize(projection, stored):
        taken = [piece[chosen] for piece in stored]
        if shifts and isinstance(projection, Int4Experts):
            return projection.dequantize(*taken, shifts=True)
        return projection.dequantize(*taken)

    gate, up, down = map(dequantize, projections, pieces)  # [P, in, out] each
    hidden = jax.nn.silu(jnp.einsum("pd,pdf->pf", rows, gate)) * jnp.einsum("pd,pdf->pf", rows, up)
    return jnp.einsum("pf,pfd->pd", hidden, down)


def _combine_weights(experts: jax.Array, weights: jax.Array, n_experts: int) -> jax.Array:
    """[N, E]: each token's routing weight per expert, zero for the experts it did not choose."""
    return (jax.nn.one_hot(experts, n_experts) * weights[..., None]).sum(1)


def _one_expert(rows: jax.Array, projections, stored: list[tuple[jax.Array, ...]]) -> jax.Array:
    """One expert's SwiGLU on rows [N, D], its gate, up
    and down dequantized from their ``stored`` pieces."""
    gate, up, down = (p.dequantize(*s) for p, s in zip(projections, stored, strict=True))
    return (jax.nn.silu(rows @ gate) * (rows @ up)) @ down


def _scanned_experts(x, weights, experts, projections, pieces) -> jax.Array:
    """``dense`` one expert at a time: each step dequantizes
    one expert's gate, up and down; fp32 [N, D]."""
    combine = _combine_weights(experts, weights, pieces[0][0].shape[0])

    def step(total, expert):
        share, *stored = expert
        return total + _one_expert(x, projections, stored).astype(jnp.float32) * share[
            :, None
        ], None

    total = jnp.zeros((x.shape[0], x.shape[-1]), jnp.float32)
    return jax.lax.scan(step, total, (combine.T, *pieces))[0]


def _skipping_experts(x, weights, experts, projections, pieces) -> jax.Array:
    """``dense`` one expert at a time over the experts some token
    chose, in id order; each step dequantizes its expert; fp32 [N, D].

    A short verify chooses only some of the experts, so this skips the rest of ``dense``'s work. A
    loop rather than a cond per expert: one compiled body (unrolled conds lengthen every round's
    compile)."""
    n_experts = pieces[0][0].shape[0]
    combine = _combine_weights(experts, weights, n_experts)
    chosen = (combine != 0).any(0)
    ids = jnp.sort(jnp.where(chosen, jnp.arange(n_experts), n_experts))  # the chosen experts first

    def step(i, total):
        expert = ids[i]
        share = jax.lax.dynamic_index_in_dim(combine, expert, axis=1)  # [N, 1]
        stored = [tuple(s[expert] for s in piece) for piece in pieces]
        return total + _one_expert(x, projections, stored).astype(jnp.float32) * share

    return jax.lax.fori_loop(
        0, chosen.sum(), step, jnp.zeros((x.shape[0], x.shape[-1]), jnp.float32)
    )


def _tiled_experts(x, weights, experts, projections, pieces) -> jax.Array:
    """Megablocks-style: the (token, slot) pairs sorted by expert into tiles of one expert
    each (an expert's last tile padded with zero rows), one tile's matmuls per scan step,
    the steps past the last used tile skipped. k/E of ``dense``'s work plus at most one
    padded tile per expert; each step dequantizes only its expert; fp32 [N, D]."""
    n, k = experts.shape
    pairs = n * k
    n_experts = pieces[0][0].shape[0]
    # About one tile per expert when the pairs spread
    # evenly; 8..32 rows keep the matmuls efficient on CPU.
    tile = int(np.clip(1 << (max(pairs // n_experts, 1).bit_length() - 1), 8, 32))
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pair indices grouped by expert
    by_expert = flat[order]
    sizes = jnp.bincount(flat, length=n_experts)
    tiles = -(-sizes // tile)  # tiles per expert
    tile_end = jnp.cumsum(tiles)
    # Each sorted pair's row in the tiled layout: its expert's
    # first row plus its rank among the expert's pairs.
    rank = jnp.arange(pairs) - (jnp.cumsum(sizes) - sizes)[by_expert]
    row_of_sorted = (tile_end - tiles)[by_expert] * tile + rank
    n_tiles = -(-pairs // tile) + n_experts  # sum over experts of ceil(size / tile) is at most this
    token_of_row = jnp.full((n_tiles * tile,), n, jnp.int32).at[row_of_sorted].set(order // k)
    # padding rows read the zero row n
    rows = jnp.concatenate([x, jnp.zeros_like(x[:1])])[token_of_row]
    tile_expert = jnp.minimum(
        jnp.searchsorted(tile_end, jnp.arange(n_tiles), side="right"), n_experts - 1
    )
    used = jnp.arange(n_tiles) < tile_end[-1]

    def step(_, tile_inputs):
        rows, expert, used = tile_inputs

        def run(rows):
            return _one_expert(
                rows, projections, [tuple(s[expert] for s in piece) for piece in pieces]
            )

        return None, jax.lax.cond(used, run, jnp.zeros_like, rows)

    out = jax.lax.scan(step, None, (rows.reshape(n_tiles, tile, -1), tile_expert, used))[1]
    row_of_pair = jnp.zeros((pairs,), jnp.int32).at[order].set(row_of_sorted)
    out = out.reshape(n_tiles * tile, -1)[row_of_pair].reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", out.astype(jnp.float32), weights)


def _all_experts(x, weights, experts, gate, up, down) -> jax.Array:
    """Every expert on every token, weighted by the combine
    weights (zero for unchosen experts); fp32 [N, D]."""
    combine = _combine_weights(experts, weights, gate.shape[0])
    # Each expert gets its own copy of the rows, zeroed where it is not chosen: a true batch
    # dimension, so the matmuls read [E, D, F] as stored. With x shared by all experts XLA folds
    # the experts into one wide matmul and relays out every gate and up weight on every call.
    rows = jnp.where((combine.T != 0)[:, :, None], x[None], 0)  # [E, N, D]
    hidden = jax.nn.silu(jnp.einsum("end,edf->enf", rows, gate)) * jnp.einsum(
        "end,edf->enf", rows, up
    )
    out = jnp.einsum("enf,efd->end", hidden, down)
    return jnp.einsum("end,ne->nd", out.astype(jnp.float32), combine)
