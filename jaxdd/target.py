"""The Kimi K2.x / DeepSeek-V3 target model in Flax NNX: MLA attention over a latent cache and noaux_tc MoE.

One forward serves every use: prefill, one-token decode, a causal block (linear verify) and a draft tree.
The new tokens see the committed prefix of the cache (slots below ``cache.length``) plus whichever new tokens
``visible`` allows; their latent rows are written at slots ``length .. length + T - 1``; committing (moving
``length``, or compacting an accepted tree path) is the caller's job.

Weights use the JAX layout ``x @ W`` ([in, out]); ``jaxdd.hf_weights`` maps the HF names and transposes.
"""

from __future__ import annotations

import functools
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdd.cache import LatentCache, write_rows
from jaxdd.config import KimiConfig
from jaxdd.layers import MLP, RMSNorm, apply_rope, param, project_heads, rope_cos_sin, rope_frequencies
from jaxdd.quant import DENSE, DenseExperts, ExpertFormat, expert_weights
from jaxdd.sharding import AXIS, expert_specs, partition_spec
from pallas_kernels.tree_attention import tree_attention

MlaForm = Literal["naive", "absorbed", "pallas"]


class TargetOutput(NamedTuple):
    hidden: jax.Array  # [B, T, D] after the final norm (feed to ``KimiTarget.logits``)
    taps: jax.Array | None  # [B, T, len(taps) * D]: residual stream after each tapped layer, concatenated
    cache: LatentCache  # new rows written, ``length`` unchanged


def attention_mask(length: jax.Array, visible: jax.Array, slots: int) -> jax.Array:
    """[B, T, slots]: committed slots (< length) for everyone; new token j's slot (length + j) where visible."""
    slot = jnp.arange(slots)[None, None, :]
    start = length[:, None, None]
    new_index = jnp.clip(slot - start, 0, visible.shape[-1] - 1)
    is_new = (slot >= start) & (slot < start + visible.shape[-1])
    new_visible = jnp.take_along_axis(visible, jnp.broadcast_to(new_index, (*visible.shape[:2], slots)), axis=-1)
    return (slot < start) | (is_new & new_visible)


def _after(value: jax.Array, rows: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """``rows`` unchanged, made to depend on ``value``: their write into the cache is then scheduled after the
    reads of the cache that produced ``value``, so it can update the (donated) buffer in place. XLA has no other
    way to order them (``optimization_barrier`` is dropped on CPU). ``nan_to_num`` keeps the sum exact: 0 * x is
    0 for any finite x."""
    zero = 0 * jnp.nan_to_num(value.reshape(-1)[0])
    return tuple(r + zero.astype(r.dtype) for r in rows)


def target_rope(config: KimiConfig) -> tuple[np.ndarray, float]:
    """(inv_freq, amplitude) of the MLA rope slice."""
    return rope_frequencies(config.qk_rope_head_dim, config.rope_theta, config.yarn)


class MLAttention(nnx.Module):
    """Multi-head latent attention. K/V live in the cache as one normed latent row plus one rope key per token.

    ``naive`` expands the latents into per-head keys and values (HF's formulation); ``absorbed`` folds the
    key up-projection into the query and the value up-projection after the attention (DeepSeek's decode form),
    so attention runs over the 512 + 64 wide rows directly. They are equal up to float reassociation.
    ``pallas`` is the absorbed form with the attention itself in the Pallas tree-attention kernel
    (``pallas_kernels.tree_attention``; interpreted on CPU).
    """

    def __init__(self, config: KimiConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        c = config
        h, dn, dr, dv = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.config = c
        self.q_a_proj = param(rngs, (c.hidden_size, c.q_lora_rank), dtype, ("embed", "q_lora"))
        self.q_a_norm = RMSNorm(c.q_lora_rank, c.latent_norm_eps, dtype, axis="q_lora")
        self.q_b_proj = param(rngs, (c.q_lora_rank, h, dn + dr), dtype, ("q_lora", "heads", None))
        self.kv_a_proj = param(rngs, (c.hidden_size, c.kv_lora_rank + dr), dtype, ("embed", None))
        self.kv_a_norm = RMSNorm(c.kv_lora_rank, c.latent_norm_eps, dtype, axis=None)
        # kv_b_proj split per head into its key half (nope channels) and value half, heads first and each head's
        # matrix laid out as absorbed attention multiplies it: stored [latent, heads, d], XLA relaid both out on
        # every call (8 weight copies per forward of the demo target, ~5% of a one-token step on CPU).
        self.k_up = param(rngs, (h, c.kv_lora_rank, dn), dtype, ("heads", None, None))
        self.v_up = param(rngs, (h, dv, c.kv_lora_rank), dtype, ("heads", None, None))
        self.o_proj = param(rngs, (h, dv, c.hidden_size), dtype, ("heads", None, "embed"))
        self.placement = None  # (mesh, mode) once placed by ``jaxdd.sharding.shard_module``

    def __call__(
        self,
        x: jax.Array,
        cos_sin: tuple[jax.Array, jax.Array],
        cache_rows: tuple[jax.Array, jax.Array],
        length: jax.Array,
        visible: jax.Array,
        mask: jax.Array,
        form: MlaForm,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """x [B,T,D]; cache_rows (latent [B,S,r], rope [B,S,dr]); the new tokens see the committed slots
        (< length) and each other where visible [B,T,T]; mask [B,T,S] is the same over the cache slots.

        This step's rows go to slots ``length .. length + T - 1``: ``naive`` and ``pallas`` write them first and
        attend over the cache alone (no concatenated copy of it per layer); ``absorbed`` attends to the cache and
        the new rows separately and writes them last. Returns the output [B,T,D] and the updated rows.
        """
        c = self.config
        cos, sin = cos_sin
        q = self.q_a_norm(x @ self.q_a_proj[...])
        q = jnp.einsum("btq,qhd->bthd", q, self.q_b_proj[...])
        q_nope, q_pe = q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim :]
        q_pe = apply_rope(q_pe, cos[:, :, None], sin[:, :, None], c.rope_interleave)

        kv = x @ self.kv_a_proj[...]
        latent = self.kv_a_norm(kv[..., : c.kv_lora_rank])  # the norm covers the latent only, not the rope key
        k_pe = apply_rope(kv[..., c.kv_lora_rank :], cos, sin, c.rope_interleave)

        if form == "absorbed":
            # The committed cache and the new rows as two sets of keys joined for one softmax, the new rows
            # written afterwards. Written first (one set of keys), a one-token step made XLA:CPU copy each
            # layer's whole cache four times: the kimi-mini AR step took 1.37 instead of 0.98 ms at 1280 slots
            # (~8% more at 256); verify rounds had no copies either way.
            q_latent = jnp.einsum("bthd,hrd->bthr", q_nope, self.k_up[...])
            cache_latent, cache_rope = cache_rows
            slots = cache_latent.shape[1]
            committed = jnp.broadcast_to(jnp.arange(slots) < length[:, None, None], (*visible.shape[:2], slots))
            scores = jnp.concatenate(
                [
                    jnp.einsum("bthr,bsr->bhts", q_latent, cache_latent)
                    + jnp.einsum("bthd,bsd->bhts", q_pe, cache_rope),
                    jnp.einsum("bthr,bur->bhtu", q_latent, latent) + jnp.einsum("bthd,bud->bhtu", q_pe, k_pe),
                ],
                axis=-1,
            )
            probs = self._softmax(scores, jnp.concatenate([committed, visible], -1))
            # Cache first: XLA:CPU then keeps the cache as stored in this batched matmul (a 128-row decode step
            # 84 -> 64 ms; the same at one row).
            out_latent = jnp.einsum("bsr,bhts->bthr", cache_latent, probs[..., :slots])
            out_latent += jnp.einsum("bur,bhtu->bthr", latent, probs[..., slots:])
            out = jnp.einsum("bthr,hdr->bthd", out_latent, self.v_up[...])
            rows = _after(out_latent, (latent, k_pe))
            new_rows = write_rows(cache_latent, rows[0], length), write_rows(cache_rope, rows[1], length)
            return project_heads(out, self.o_proj[...]), new_rows

        keys_latent = write_rows(cache_rows[0], latent, length)  # [B, S, r]
        keys_rope = write_rows(cache_rows[1], k_pe, length)  # [B, S, dr]
        if form == "pallas":
            q_latent = jnp.einsum("bthd,hrd->bthr", q_nope, self.k_up[...])
            attend = functools.partial(tree_attention, scale=c.softmax_scale, interpret=jax.default_backend() == "cpu")
            if self.placement is not None and partition_spec((c.num_attention_heads,), ("heads",), *self.placement)[0]:
                # A Pallas kernel is opaque to XLA's partitioner: run it per device on that device's heads.
                heads, whole = jax.sharding.PartitionSpec(None, None, AXIS), jax.sharding.PartitionSpec()
                specs = (heads, heads, *(whole,) * 6)
                mesh = self.placement[0]
                attend = jax.shard_map(attend, mesh=mesh, in_specs=specs, out_specs=heads, check_vma=False)
            out_latent = attend(q_latent, q_pe, keys_latent, keys_rope, length, latent, k_pe, visible)
            out = jnp.einsum("bthr,hdr->bthd", out_latent.astype(x.dtype), self.v_up[...])
        elif form == "naive":
            k_nope = jnp.einsum("bsr,hrd->bshd", keys_latent, self.k_up[...])
            values = jnp.einsum("bsr,hdr->bshd", keys_latent, self.v_up[...])
            # One score matmul over the [nope | rope] channels, as HF concatenates them: XLA:CPU takes ~2x as
            # long for the two matmuls and their sum (a 160-token prefill layer: 0.59 -> 0.33 ms).
            k_pe_heads = jnp.broadcast_to(keys_rope[:, :, None], (*k_nope.shape[:3], c.qk_rope_head_dim))
            keys = jnp.concatenate([k_nope, k_pe_heads], axis=-1)
            scores = jnp.einsum("bthd,bshd->bhts", jnp.concatenate([q_nope, q_pe], axis=-1), keys)
            out = jnp.einsum("bhts,bshd->bthd", self._softmax(scores, mask), values)
        else:
            raise ValueError(f"form: expected 'naive', 'absorbed' or 'pallas', got {form!r}")
        return project_heads(out, self.o_proj[...]), (keys_latent, keys_rope)

    def _softmax(self, scores: jax.Array, mask: jax.Array) -> jax.Array:
        # HF: scale in the activation dtype, softmax in fp32, probabilities back in the activation dtype.
        scores = (scores * self.config.softmax_scale).astype(jnp.float32)
        scores = jnp.where(mask[:, None], scores, -jnp.inf)
        return jax.nn.softmax(scores, axis=-1).astype(self.k_up.dtype)


class Router(nnx.Module):
    """noaux_tc routing: sigmoid scores; the correction bias picks experts but does not weight them."""

    def __init__(self, config: KimiConfig, rngs: nnx.Rngs):
        self.config = config
        e = config.n_routed_experts
        # fp32 like the reference (HF keeps gate.weight and e_score_correction_bias in fp32).
        self.weight = param(rngs, (config.hidden_size, e), jnp.float32, ("embed", None))
        self.bias = nnx.Param(jnp.zeros((e,), jnp.float32), logical_axes=(None,))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [N, D] -> (weights [N, k] fp32, expert ids [N, k] int32)."""
        c = self.config
        scores = jax.nn.sigmoid(x.astype(jnp.float32) @ self.weight[...])
        choice = scores + self.bias[...]
        if c.n_group > 1:
            n, per_group = x.shape[0], c.n_routed_experts // c.n_group
            grouped = choice.reshape(n, c.n_group, per_group)
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
            keep = jax.nn.one_hot(jax.lax.top_k(group_scores, c.topk_group)[1], c.n_group).sum(-2) > 0
            choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(n, c.n_routed_experts)
        experts = jax.lax.top_k(choice, c.num_experts_per_tok)[1]
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        return weights * c.routed_scaling_factor, experts


class MoE(nnx.Module):
    """Routed SwiGLU experts plus unweighted shared experts.

    Five exact dispatches: ``grouped`` sorts the (token, slot) pairs by expert and runs grouped matmuls
    (``ragged_dot``), the scalable form for dense weights; ``dense`` runs every expert on every token and weights
    the outputs by the combine weights (zero for unchosen experts); ``scan`` does the same one expert at a time;
    ``skipping`` too, but skips the experts no token chose; ``tiled`` sorts the pairs by expert into tiles of one
    expert each and runs the used tiles one at a time. XLA:CPU lowers ragged_dot to a dense matmul over all
    experts for every pair, k times the work of ``dense``, so on CPU ``auto`` takes ``skipping`` for a few tokens
    and ``tiled`` beyond (prefill, wide verifies) for unquantized experts.

    Expert weights may be stored quantized (``jaxdd.quant.ExpertFormat``) and are dequantized to the model dtype
    inside the jitted forward. Dequantizing a whole expert stack at once would need its dense copy in memory
    (and XLA may hoist those copies for all layers to the start of the step), so beyond small problems
    quantized experts go through ``scan``: one expert dequantized at a time, right before its matmuls.
    """

    DENSE_MAX_FLOPS = 2**28  # ``auto``: all-experts compute below this many multiply-adds
    # ``auto`` on CPU: tiles from this many tokens, ``skipping`` below. kimi-mini's routed experts (8, top 2, half
    # the pairs on one expert), skipping vs tiled: 9 tokens 0.27 vs 0.33 ms, 16 tokens 0.45 vs 0.46, 24 tokens 0.59
    # vs 0.58, 33 tokens 0.65 vs 0.59, 48 tokens 0.85 vs 0.69; (dense vs tiled: 65 tokens 1.79 vs 0.96 ms).
    TILED_MIN_TOKENS = 24

    def __init__(self, config: KimiConfig, dtype: jnp.dtype, experts: ExpertFormat, rngs: nnx.Rngs):
        c = config
        e, d, f = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
        self.config = c
        self.dispatch: Literal["auto", "dense", "grouped", "scan", "skipping", "tiled"] = "auto"
        self.placement = None  # (mesh, "tp" | "ep") once placed by ``jaxdd.sharding.shard_module``
        self.router = Router(c, rngs)
        self.gate = expert_weights(experts, rngs, (e, d, f), dtype, ("experts", "embed", "expert_mlp"))
        self.up = expert_weights(experts, rngs, (e, d, f), dtype, ("experts", "embed", "expert_mlp"))
        self.down = expert_weights(experts, rngs, (e, f, d), dtype, ("experts", "expert_mlp", "embed"))
        self.shared = MLP(d, f * c.n_shared_experts, dtype, rngs) if c.n_shared_experts else None

    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts = self.router(x)
        if self.placement is None:
            routed = self._routed(x, weights, experts, [p.stored() for p in (self.gate, self.up, self.down)])
        else:
            routed = self._sharded_routed(x, weights, experts)
        routed = routed.astype(x.dtype)
        if self.shared is not None:
            routed = routed + self.shared(x)
        return routed.reshape(shape)

    def _routed(self, x, weights, experts, pieces: list[tuple[jax.Array, ...]]) -> jax.Array:
        """fp32 [N, D]: the weighted expert outputs, for experts [N, k] indexing the stored ``pieces`` of
        gate, up and down ([E, ...] each: all experts, or one device's)."""
        projections = (self.gate, self.up, self.down)
        n_experts = pieces[0][0].shape[0]
        dispatch = self.dispatch
        if dispatch == "auto":
            c = self.config
            flops = 3 * x.shape[0] * n_experts * c.hidden_size * c.moe_intermediate_size
            quantized = not isinstance(self.gate, DenseExperts)
            # Quantized experts keep ``scan``: ``jaxdd.plan`` compiles Kimi on CPU for GPU memory budgets.
            if jax.default_backend() == "cpu" and not quantized and x.shape[0] >= self.TILED_MIN_TOKENS:
                dispatch = "tiled"
            elif jax.default_backend() == "cpu" and not quantized:
                dispatch = "skipping"
            else:
                dispatch = "dense" if flops <= self.DENSE_MAX_FLOPS else "scan" if quantized else "grouped"
        if dispatch == "scan":
            return _scanned_experts(x, weights, experts, projections, pieces)
        if dispatch == "skipping":
            return _skipping_experts(x, weights, experts, projections, pieces)
        if dispatch == "tiled":
            return _tiled_experts(x, weights, experts, projections, pieces)
        dense = [p.dequantize(*stored) for p, stored in zip(projections, pieces, strict=True)]
        return (_all_experts if dispatch == "dense" else _grouped_experts)(x, weights, experts, *dense)

    def _sharded_routed(self, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
        """The routed experts under ``shard_map`` (see ``jaxdd.sharding``): each device holds a slice of every
        expert (tp) or whole experts (ep), sees every (token, route) pair, computes its share and the shares
        are summed across devices: no ragged all-to-all, which XLA:CPU lacks."""
        mesh, mode = self.placement
        projections = (self.gate, self.up, self.down)
        specs = expert_specs(projections, mesh, mode)
        pieces = [p.stored() for p in projections]
        replicated = jax.sharding.PartitionSpec()
        local_experts = self.config.n_routed_experts // (mesh.shape[AXIS] if specs[0][0] == AXIS else 1)

        def local(x, weights, experts, gate_pieces, up_pieces, down_pieces):
            first = jax.lax.axis_index(AXIS) * local_experts if local_experts < self.config.n_routed_experts else 0
            ids = experts - first
            mine = (ids >= 0) & (ids < local_experts)
            # Routes to other devices' experts get weight 0 (and any local id, so shapes stay static).
            ids, weights = jnp.where(mine, ids, 0), jnp.where(mine, weights, 0.0)
            local_pieces = [gate_pieces, up_pieces, down_pieces]
            return jax.lax.psum(self._routed(x, weights, ids, local_pieces), AXIS)

        in_specs = (
            replicated,
            replicated,
            replicated,
            *[(spec,) * len(p) for spec, p in zip(specs, pieces, strict=True)],
        )
        sharded = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=replicated, check_vma=False)
        return sharded(x, weights, experts, *pieces)


def _grouped_experts(x, weights, experts, gate, up, down) -> jax.Array:
    """(token, slot) pairs sorted by expert through grouped matmuls (``ragged_dot``); fp32 [N, D]."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    rows = x[order // k]
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
    hidden = jax.nn.silu(jax.lax.ragged_dot(rows, gate, sizes)) * jax.lax.ragged_dot(rows, up, sizes)
    out = jax.lax.ragged_dot(hidden, down, sizes)
    out = jnp.zeros_like(out).at[order].set(out).reshape(n, k, -1)
    # Moonshot's moe_infer: expert outputs summed with their weights in fp32 (cast back by the caller).
    return jnp.einsum("nkd,nk->nd", out.astype(jnp.float32), weights)


def _combine_weights(experts: jax.Array, weights: jax.Array, n_experts: int) -> jax.Array:
    """[N, E]: each token's routing weight per expert, zero for the experts it did not choose."""
    return (jax.nn.one_hot(experts, n_experts) * weights[..., None]).sum(1)


def _one_expert(rows: jax.Array, projections, stored: list[tuple[jax.Array, ...]]) -> jax.Array:
    """One expert's SwiGLU on rows [N, D], its gate, up and down dequantized from their ``stored`` pieces."""
    gate, up, down = (p.dequantize(*s) for p, s in zip(projections, stored, strict=True))
    return (jax.nn.silu(rows @ gate) * (rows @ up)) @ down


def _scanned_experts(x, weights, experts, projections, pieces) -> jax.Array:
    """``dense`` one expert at a time: each step dequantizes one expert's gate, up and down; fp32 [N, D]."""
    combine = _combine_weights(experts, weights, pieces[0][0].shape[0])

    def step(total, expert):
        share, *stored = expert
        return total + _one_expert(x, projections, stored).astype(jnp.float32) * share[:, None], None

    total = jnp.zeros((x.shape[0], x.shape[-1]), jnp.float32)
    return jax.lax.scan(step, total, (combine.T, *pieces))[0]


def _skipping_experts(x, weights, experts, projections, pieces) -> jax.Array:
    """``dense`` one expert at a time over the experts some token chose, in id order; each step dequantizes its
    expert; fp32 [N, D].

    kimi-mini's 8-token verify uses ~4 of its 8 experts (one expert often takes every token): the MoE layer takes
    ~140-210 us instead of ~260-290 for ``dense``'s 8 experts x 8 rows (XLA:CPU, 2 cores; with all 8 chosen,
    ~320). A loop rather than a cond per expert: one compiled body, where unrolled conds added ~2 s to the
    compile of every kimi-mini round shape for the same speed."""
    n_experts = pieces[0][0].shape[0]
    combine = _combine_weights(experts, weights, n_experts)
    chosen = (combine != 0).any(0)
    ids = jnp.sort(jnp.where(chosen, jnp.arange(n_experts), n_experts))  # the chosen experts first

    def step(i, total):
        expert = ids[i]
        share = jax.lax.dynamic_index_in_dim(combine, expert, axis=1)  # [N, 1]
        stored = [tuple(s[expert] for s in piece) for piece in pieces]
        return total + _one_expert(x, projections, stored).astype(jnp.float32) * share

    return jax.lax.fori_loop(0, chosen.sum(), step, jnp.zeros((x.shape[0], x.shape[-1]), jnp.float32))


def _tiled_experts(x, weights, experts, projections, pieces) -> jax.Array:
    """Megablocks-style: the (token, slot) pairs sorted by expert into tiles of one expert each (an expert's last
    tile padded with zero rows), one tile's matmuls per scan step, the steps past the last used tile skipped.
    k/E of ``dense``'s work plus at most one padded tile per expert; each step dequantizes only its expert; fp32
    [N, D]."""
    n, k = experts.shape
    pairs, n_experts = n * k, pieces[0][0].shape[0]
    # About one tile per expert when the pairs spread evenly; 8..32 rows keep the matmuls efficient on CPU.
    tile = int(np.clip(1 << (max(pairs // n_experts, 1).bit_length() - 1), 8, 32))
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pair indices grouped by expert
    by_expert = flat[order]
    sizes = jnp.bincount(flat, length=n_experts)
    tiles = -(-sizes // tile)  # tiles per expert
    tile_end = jnp.cumsum(tiles)
    # Each sorted pair's row in the tiled layout: its expert's first row plus its rank among the expert's pairs.
    rank = jnp.arange(pairs) - (jnp.cumsum(sizes) - sizes)[by_expert]
    row_of_sorted = (tile_end - tiles)[by_expert] * tile + rank
    n_tiles = -(-pairs // tile) + n_experts  # sum over experts of ceil(size / tile) is at most this
    token_of_row = jnp.full((n_tiles * tile,), n, jnp.int32).at[row_of_sorted].set(order // k)
    rows = jnp.concatenate([x, jnp.zeros_like(x[:1])])[token_of_row]  # padding rows read the zero row n
    tile_expert = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(n_tiles), side="right"), n_experts - 1)
    used = jnp.arange(n_tiles) < tile_end[-1]

    def step(_, tile_inputs):
        rows, expert, used = tile_inputs

        def run(rows):
            return _one_expert(rows, projections, [tuple(s[expert] for s in piece) for piece in pieces])

        return None, jax.lax.cond(used, run, jnp.zeros_like, rows)

    out = jax.lax.scan(step, None, (rows.reshape(n_tiles, tile, -1), tile_expert, used))[1]
    row_of_pair = jnp.zeros((pairs,), jnp.int32).at[order].set(row_of_sorted)
    out = out.reshape(n_tiles * tile, -1)[row_of_pair].reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", out.astype(jnp.float32), weights)


def _all_experts(x, weights, experts, gate, up, down) -> jax.Array:
    """Every expert on every token, weighted by the combine weights (zero for unchosen experts); fp32 [N, D]."""
    combine = _combine_weights(experts, weights, gate.shape[0])
    # Each expert gets its own copy of the rows, zeroed where it is not chosen: a true batch dimension, so the
    # matmuls read [E, D, F] as stored. With x shared by all experts XLA folds the experts into one wide matmul
    # and relays out every gate and up weight on every call (XLA:CPU: 1.1-2x slower up to 33 tokens).
    rows = jnp.where((combine.T != 0)[:, :, None], x[None], 0)  # [E, N, D]
    hidden = jax.nn.silu(jnp.einsum("end,edf->enf", rows, gate)) * jnp.einsum("end,edf->enf", rows, up)
    out = jnp.einsum("enf,efd->end", hidden, down)
    return jnp.einsum("end,ne->nd", out.astype(jnp.float32), combine)


class DecoderLayer(nnx.Module):
    def __init__(self, config: KimiConfig, layer: int, dtype: jnp.dtype, experts: ExpertFormat, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.attn = MLAttention(config, dtype, rngs)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if config.is_moe_layer(layer):
            self.mlp = MoE(config, dtype, experts, rngs)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, dtype, rngs)

    def __call__(self, x, cos_sin, cache_rows, length, visible, mask, form: MlaForm):
        attn, cache_rows = self.attn(self.attn_norm(x), cos_sin, cache_rows, length, visible, mask, form)
        x = x + attn
        return x + self.mlp(self.mlp_norm(x)), cache_rows


class KimiTarget(nnx.Module):
    def __init__(
        self, config: KimiConfig, dtype: jnp.dtype = jnp.bfloat16, *, experts: ExpertFormat = DENSE, rngs: nnx.Rngs
    ):
        self.config = config
        self.dtype = dtype
        self.experts = experts  # how routed-expert weights are stored
        self.placement = None  # (mesh, "tp" | "ep") once placed by ``jaxdd.sharding.shard_module``
        self.embed = param(rngs, (config.vocab_size, config.hidden_size), dtype, ("vocab", "embed"))
        layers = [DecoderLayer(config, i, dtype, experts, rngs) for i in range(config.num_hidden_layers)]
        self.layers = nnx.List(layers)
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = param(rngs, (config.hidden_size, config.vocab_size), dtype, ("embed", "vocab"))

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: LatentCache,
        visible: jax.Array,
        *,
        taps: tuple[int, ...] = (),
        form: MlaForm = "absorbed",
    ) -> TargetOutput:
        """tokens, positions [B, T] int32; visible [B, T, T] bool: may new token i attend to new token j.

        Causal ``visible`` gives prefill / decode / linear verify; an ancestor-or-self mask gives tree verify
        (with positions = start + depth).
        """
        mask = attention_mask(cache.length, visible, cache.slots)
        inv_freq, amplitude = target_rope(self.config)
        cos_sin = rope_cos_sin(positions, inv_freq, amplitude, self.dtype)

        x = self.embed_tokens(tokens)
        latent_cache, rope_cache, tapped = list(cache.latent), list(cache.rope), []
        for i, layer in enumerate(self.layers):
            rows = (latent_cache[i], rope_cache[i])
            x, (latent_cache[i], rope_cache[i]) = layer(x, cos_sin, rows, cache.length, visible, mask, form)
            if i in taps:
                tapped.append(x)
        by_layer = dict(zip(sorted(set(taps)), tapped, strict=True))
        tap_out = jnp.concatenate([by_layer[i] for i in taps], axis=-1) if taps else None
        new_cache = cache.replace(latent=tuple(latent_cache), rope=tuple(rope_cache))
        return TargetOutput(self.final_norm(x), tap_out, new_cache)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """Embedding rows for token ids. Vocab-parallel on a mesh: each device looks up the ids in its slice of
        the table, zeros the rest, and the slices are summed (a plain gather would all-gather the table)."""
        table = self.embed[...]
        if self.placement is None or partition_spec(table.shape, ("vocab", "embed"), *self.placement)[0] != AXIS:
            return table[tokens]
        mesh, _ = self.placement
        rows = self.config.vocab_size // mesh.shape[AXIS]

        def local(table, tokens):
            ids = tokens - jax.lax.axis_index(AXIS) * rows
            mine = (ids >= 0) & (ids < rows)
            return jax.lax.psum(jnp.where(mine[..., None], table[jnp.where(mine, ids, 0)], 0), AXIS)

        specs = (jax.sharding.PartitionSpec(AXIS), jax.sharding.PartitionSpec())
        return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=jax.sharding.PartitionSpec())(table, tokens)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """fp32 logits for final hidden states (the untied lm_head)."""
        return (hidden @ self.lm_head[...]).astype(jnp.float32)


def abstract_target(
    config: KimiConfig, dtype: jnp.dtype, experts: ExpertFormat = DENSE
) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's structure and its parameter shapes/dtypes, without allocating (for loading and restoring)."""
    return nnx.split(nnx.eval_shape(lambda: KimiTarget(config, dtype, experts=experts, rngs=nnx.Rngs(0))))
