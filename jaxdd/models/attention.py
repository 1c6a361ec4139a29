"""Multi-head latent attention (MLA) over the static latent cache, in three
forms: naive (HF's), absorbed (DeepSeek's decode form) and the Pallas
tree-attention kernel; each form is one method of ``MLAttention``."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from types import ModuleType

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdd.cache import CacheView
from jaxdd.cache.stripes import PAGES
from jaxdd.config import KimiConfig
from jaxdd.models.layers import RMSNorm, apply_rope, linear, param, project_heads, unmerged
from jaxdd.runtime.backend import Backend
from jaxdd.runtime.sharding import AXIS, Placeable, partition_spec
from jaxdd.types import ATTENTIONS, Attention
from pallas_kernels.tree_operands import TreeOperands

# a device's partial output leaves it in float32, to be merged with the others'
F32 = {"preferred_element_type": jnp.float32}


def _write_after(value: jax.Array, rows: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """``rows`` unchanged, made to depend on ``value``: their write into the cache is then
    scheduled after the reads of the cache that produced ``value``, so it can update the
    (donated) buffer in place. XLA has no other way to order them (``optimization_barrier``
    is dropped on CPU). ``nan_to_num`` keeps the sum exact: 0 * x is 0 for any finite x."""
    zero = 0 * jnp.nan_to_num(value.reshape(-1)[0])
    return tuple(r + zero.astype(r.dtype) for r in rows)


# Absorbed attention's products with weights and cache rows. Decoding on one CPU device
# they go through ``jaxdd.runtime.cpu_kernels`` (``kernels``; XLA:CPU runs each on one
# thread at a fraction of the read bandwidth), elsewhere through the einsum they compute.


def _per_head(x: jax.Array, weight: jax.Array, kernels: ModuleType | None) -> jax.Array:
    """x [B, T, H, K] . weight [H, N, K] -> [B, T, H, N],
    head by head (the absorbed key and value projections)."""
    if kernels is None:
        return jnp.einsum("bthk,hnk->bthn", x, weight)
    b, t, h, k = x.shape
    out = kernels.row_dot(x.transpose(2, 0, 1, 3).reshape(h, b * t, k), weight)  # [H, B * T, N]
    return out.reshape(h, b, t, -1).transpose(1, 2, 0, 3)


def _cache_scores(q: jax.Array, rows: jax.Array, kernels: ModuleType | None) -> jax.Array:
    """q [B, T, H, K] . rows [B, S, K] -> scores [B, H, T, S] over the cache's slots."""
    if kernels is None:
        return jnp.einsum("bthk,bsk->bhts", q, rows)
    b, t, h, k = q.shape
    return kernels.row_dot(q.reshape(b, t * h, k), rows).reshape(b, t, h, -1).transpose(0, 2, 1, 3)


def _cache_values(rows: jax.Array, probs: jax.Array, kernels: ModuleType | None) -> jax.Array:
    """rows [B, S, K] weighted by probs [B, H, T, S] -> [B, T, H, K]. Cache first:
    XLA:CPU then keeps the cache as stored in this batched matmul (no relayout)."""
    if kernels is None:
        return jnp.einsum("bsk,bhts->bthk", rows, probs)
    b, h, t, s = probs.shape
    out = jnp.stack([kernels.dense_matvec(probs[i].reshape(h * t, s), rows[i]) for i in range(b)])
    return out.reshape(b, h, t, -1).transpose(0, 2, 1, 3)


@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """What every form of the attention takes: the step's queries and new cache rows, the
    cache's rows and where to read and write them, and which new tokens see which."""

    q_nope: jax.Array  # [B, T, heads, qk_nope_head_dim]
    q_pe: jax.Array  # [B, T, heads, qk_rope_head_dim], rotated
    latent: jax.Array  # [B, T, kv_lora_rank]: the new tokens' normed latent rows
    k_pe: jax.Array  # [B, T, qk_rope_head_dim]: their rotated rope keys
    # this layer's latent and rope buffers: rows [B, S, r | dr] or pools of pages
    cache_rows: tuple[jax.Array, jax.Array]
    view: CacheView
    visible: jax.Array  # [B, T, T] bool: may new token i attend to new token j
    backend: Backend

    def kernel_operands(self, q_latent: jax.Array) -> TreeOperands:
        """The tree-attention kernel's operands for queries ``q_latent`` [B, T, heads,
        kv_lora_rank]: the cache's rows and their length and tables as ``view`` says."""
        latent, rope = self.cache_rows
        queries = (q_latent, self.q_pe, latent, rope, self.view.length)
        return TreeOperands(*queries, self.latent, self.k_pe, self.visible, self.view.pages)


class MLAttention(nnx.Module, Placeable):
    """Multi-head latent attention. K/V live in the cache
    as one normed latent row plus one rope key per token.

    ``naive`` expands the latents into per-head keys and values (HF's formulation); ``absorbed``
    folds the key up-projection into the query and the value up-projection after the attention
    (DeepSeek's decode form), so attention runs over the 512 + 64 wide rows directly. They are
    equal up to float reassociation. ``pallas`` is the absorbed form with the attention itself
    in the Pallas tree-attention kernel (``pallas_kernels.tree_attention``; interpreted on CPU).
    On one CPU device ``absorbed`` over pools of pages runs in the C++ one
    (``Backend.attention_kernel``).
    """

    def __init__(self, config: KimiConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        c = config
        h = c.num_attention_heads
        dn = c.qk_nope_head_dim
        dr = c.qk_rope_head_dim
        dv = c.v_head_dim
        self.config = c
        self.q_a_proj = param(rngs, (c.hidden_size, c.q_lora_rank), dtype, ("embed", "q_lora"))
        self.q_a_norm = RMSNorm(c.q_lora_rank, c.latent_norm_eps, dtype, axis="q_lora")
        self.q_b_proj = param(rngs, (c.q_lora_rank, h, dn + dr), dtype, ("q_lora", "heads", None))
        self.kv_a_proj = param(rngs, (c.hidden_size, c.kv_lora_rank + dr), dtype, ("embed", None))
        self.kv_a_norm = RMSNorm(c.kv_lora_rank, c.latent_norm_eps, dtype, axis=None)
        # kv_b_proj split per head into its key half (nope channels) and value half, heads first and
        # each head's matrix laid out as absorbed attention multiplies it: stored [latent, heads,
        # d], XLA relays both out on every call.
        self.k_up = param(rngs, (h, c.kv_lora_rank, dn), dtype, ("heads", None, None))
        self.v_up = param(rngs, (h, dv, c.kv_lora_rank), dtype, ("heads", None, None))
        self.o_proj = param(rngs, (h, dv, c.hidden_size), dtype, ("heads", None, "embed"))
        self.placement = None  # (mesh, mode) once placed by ``jaxdd.runtime.sharding.shard_module``

    def __call__(
        self,
        x: jax.Array,
        cos_sin: tuple[jax.Array, jax.Array],
        cache_rows: tuple[jax.Array, jax.Array],
        view: CacheView,
        visible: jax.Array,
        attention: Attention,
        backend: Backend,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """x [B,T,D]; cache_rows (latent [B,S,r], rope [B,S,dr]); the new tokens see
        the committed cache (``view``) and each other where visible [B,T,T].

        This step's rows go where ``view`` writes: ``naive`` and ``pallas`` write them
        first and attend over the cache alone (no concatenated copy of it per layer);
        ``absorbed`` attends to the cache and the new rows separately and writes them
        last. Returns the output [B,T,D] and the updated rows.
        """
        c = self.config
        cos, sin = cos_sin
        q = self.q_a_norm(linear(*unmerged(x, self.q_a_proj[...]), backend))
        q = linear(q, self.q_b_proj[...], backend)  # [B, T, heads, d]
        q_nope = q[..., : c.qk_nope_head_dim]
        q_pe = q[..., c.qk_nope_head_dim :]
        q_pe = apply_rope(q_pe, cos[:, :, None], sin[:, :, None], c.rope_interleave)

        kv = linear(*unmerged(x, self.kv_a_proj[...]), backend)
        # the norm covers the latent only, not the rope key
        latent = self.kv_a_norm(kv[..., : c.kv_lora_rank])
        k_pe = apply_rope(kv[..., c.kv_lora_rank :], cos, sin, c.rope_interleave)

        if attention not in ATTENTIONS:
            raise ValueError(
                f"attention: expected 'naive', 'absorbed' or 'pallas', got {attention!r}"
            )
        inputs = AttentionInputs(q_nope, q_pe, latent, k_pe, cache_rows, view, visible, backend)
        kernel = backend.attention_kernel(attention, view.pages is not None)
        if kernel is not None:
            out, rows = self._in_kernel(inputs, kernel)
        else:
            out, rows = (self._naive if attention == "naive" else self._absorbed)(inputs)
        return project_heads(out, self.o_proj[...], backend), rows

    def _absorbed(self, inputs: AttentionInputs):
        """The committed cache and the new rows as two sets of keys joined
        for one softmax, the new rows written afterwards: written first, a
        one-token step makes XLA:CPU copy each layer's whole cache."""
        if inputs.view.stripes is not None:
            return self._striped(inputs, self._absorbed_local)
        q_pe = inputs.q_pe
        latent = inputs.latent
        k_pe = inputs.k_pe
        visible = inputs.visible
        kernels = inputs.backend.decode_kernels(q_pe.shape[0] * q_pe.shape[1])
        q_latent = _per_head(inputs.q_nope, self.k_up[...], kernels)
        cache_latent, cache_rope = map(inputs.view.read, inputs.cache_rows)
        slots = cache_latent.shape[1]
        committed = jnp.broadcast_to(
            inputs.view.committed(slots)[:, None, :], (*visible.shape[:2], slots)
        )
        scores = jnp.concatenate(
            [
                _cache_scores(q_latent, cache_latent, kernels)
                + _cache_scores(q_pe, cache_rope, kernels),
                jnp.einsum("bthr,bur->bhtu", q_latent, latent)
                + jnp.einsum("bthd,bud->bhtu", q_pe, k_pe),
            ],
            axis=-1,
        )
        probs = self._softmax(scores, jnp.concatenate([committed, visible], -1))
        out_latent = _cache_values(cache_latent, probs[..., :slots], kernels)
        out_latent += jnp.einsum("bur,bhtu->bthr", latent, probs[..., slots:])
        out = _per_head(out_latent, self.v_up[...], kernels)
        rows = _write_after(out_latent, (latent, k_pe))
        return out, tuple(map(inputs.view.write, inputs.cache_rows, rows))

    def _striped(self, inputs: AttentionInputs, attend_local: Callable) -> tuple:
        """Attention over a cache striped over the devices (``jaxdd.cache.stripes``): each
        device runs ``attend_local`` (the kernel's ``with_lse`` form: (out, log-sum-exp) of
        operands over its pools and its own pages, and the view of those pages) for all heads
        over them,
        device 0 over the new rows too, and the partials merge by their log-sum-exp into each
        device's heads."""
        stripes = inputs.view.stripes
        heads = self.config.num_attention_heads
        split = partition_spec((heads,), ("heads",), stripes.mesh, "tp")[0] is not None
        q_latent = jnp.einsum("bthk,hnk->bthn", inputs.q_nope, self.k_up[...])

        def attend(ops: TreeOperands, view: CacheView) -> jax.Array:
            device = jax.lax.axis_index(AXIS)
            local = stripes.local_view(view, device, ops.cache_latent.shape[0])
            mine = ops.replace(
                length=local.length, pages=local.pages, tail_mask=ops.tail_mask & (device == 0)
            )
            out, lse = attend_local(mine, local)
            return stripes.merge(out, lse, split)

        whole = jax.sharding.PartitionSpec()
        out_spec = jax.sharding.PartitionSpec(None, None, AXIS) if split else whole
        ops = inputs.kernel_operands(q_latent)
        specs = jax.tree.map(lambda _: whole, ops).replace(cache_latent=PAGES, cache_rope=PAGES)
        out_latent = stripes.per_device(attend, (specs, whole), out_spec)(ops, inputs.view)
        out_latent = out_latent.astype(inputs.q_pe.dtype)
        out = jnp.einsum("bthr,hdr->bthd", out_latent, self.v_up[...])
        rows = _write_after(out_latent, (inputs.latent, inputs.k_pe))
        return out, tuple(map(inputs.view.write, inputs.cache_rows, rows))

    def _absorbed_local(self, ops: TreeOperands, view: CacheView) -> tuple[jax.Array, jax.Array]:
        """The absorbed attention over ``ops``, their pools' committed slots read through
        ``view`` (their length and tables), as the kernel's ``with_lse`` form: (out [B,T,H,r]
        fp32, log-sum-exp [B,T,H]); a token that sees nothing gives 0 and -inf. Scores and
        probabilities in the dtypes of ``_softmax``."""
        cache_latent, cache_rope = view.read(ops.cache_latent), view.read(ops.cache_rope)
        q_latent, q_pe, latent, k_pe = ops.q_latent, ops.q_rope, ops.tail_latent, ops.tail_rope
        visible = ops.tail_mask
        slots = cache_latent.shape[1]
        scores = jnp.concatenate(
            [
                jnp.einsum("bthr,bsr->bhts", q_latent, cache_latent)
                + jnp.einsum("bthd,bsd->bhts", q_pe, cache_rope),
                jnp.einsum("bthr,bur->bhtu", q_latent, latent)
                + jnp.einsum("bthd,bud->bhtu", q_pe, k_pe),
            ],
            axis=-1,
        )
        committed = view.committed(slots)[:, None, :]
        mask = jnp.concatenate(
            [jnp.broadcast_to(committed, (*visible.shape[:2], slots)), visible], -1
        )
        scores = (scores * self.config.softmax_scale).astype(jnp.float32)
        scores = jnp.where(mask[:, None], scores, -jnp.inf)
        top = scores.max(-1, keepdims=True)
        top = jnp.where(jnp.isfinite(top), top, 0.0)
        exp = jnp.exp(scores - top)
        total = exp.sum(-1, keepdims=True)
        probs = (exp / jnp.where(total > 0, total, 1.0)).astype(self.k_up.dtype)
        out = jnp.einsum("bsk,bhts->bthk", cache_latent, probs[..., :slots], **F32)
        out += jnp.einsum("bur,bhtu->bthr", latent, probs[..., slots:], **F32)
        lse = (top + jnp.log(total))[..., 0]  # [B, H, T]
        return out, lse.transpose(0, 2, 1)

    def _in_kernel(self, inputs: AttentionInputs, kernel: Callable):
        """The absorbed form with the attention itself in a tree-attention kernel
        (``Backend.attention_kernel``)."""
        c = self.config
        kernel = functools.partial(kernel, scale=c.softmax_scale)
        if inputs.view.stripes is not None:

            def attend_local(ops: TreeOperands, view: CacheView) -> tuple[jax.Array, jax.Array]:
                return kernel(ops, with_lse=True)  # reads the pages through ops' own tables

            return self._striped(inputs, attend_local)
        kernels = inputs.backend.decode_kernels(inputs.q_pe.shape[0] * inputs.q_pe.shape[1])
        q_latent = _per_head(inputs.q_nope, self.k_up[...], kernels)

        def attend(ops: TreeOperands) -> tuple[jax.Array, ...]:
            # The committed rows only (slots < length), read through the page tables: the kernel
            # reads the cache as it was, and the new rows, made to depend on its output (else
            # XLA:GPU may schedule their write first, into a copy of the cache), are written
            # after it in place.
            out = kernel(ops)
            return out, *_write_after(out, (ops.tail_latent, ops.tail_rope))

        ops = inputs.kernel_operands(q_latent)

        if self.placement is not None and self.placement[0].size > 1:
            # A Pallas kernel is opaque to XLA's partitioner: run it per device on
            # that device's heads (all of them where the mesh does not split the
            # heads; Mosaic refuses to be partitioned at all). The rows depend on
            # each device's own output, so ordering them needs no collective.
            split = partition_spec((c.num_attention_heads,), ("heads",), *self.placement)[0]
            whole = jax.sharding.PartitionSpec()
            heads = jax.sharding.PartitionSpec(None, None, AXIS) if split else whole
            specs = jax.tree.map(lambda _: whole, ops).replace(q_latent=heads, q_rope=heads)
            mesh = self.placement[0]
            attend = jax.shard_map(
                attend,
                mesh=mesh,
                in_specs=(specs,),
                out_specs=(heads, whole, whole),
                check_vma=False,
            )
        out_latent, *rows = attend(ops)
        out = _per_head(out_latent.astype(inputs.q_pe.dtype), self.v_up[...], kernels)
        return out, tuple(map(inputs.view.write, inputs.cache_rows, rows))

    def _naive(self, inputs: AttentionInputs):
        """HF's formulation: the latents expanded into
        per-head keys and values, the rows written first."""
        c = self.config
        written = tuple(map(inputs.view.write, inputs.cache_rows, (inputs.latent, inputs.k_pe)))
        keys_latent, keys_rope = map(inputs.view.read, written)  # [B, S, r | dr]
        k_nope = jnp.einsum("bsr,hrd->bshd", keys_latent, self.k_up[...])
        values = jnp.einsum("bsr,hdr->bshd", keys_latent, self.v_up[...])
        # One score matmul over the [nope | rope] channels, as HF concatenates them: on XLA:CPU two
        # matmuls and their sum cost more.
        k_pe_heads = jnp.broadcast_to(
            keys_rope[:, :, None], (*k_nope.shape[:3], c.qk_rope_head_dim)
        )
        keys = jnp.concatenate([k_nope, k_pe_heads], axis=-1)
        query = jnp.concatenate([inputs.q_nope, inputs.q_pe], axis=-1)
        scores = jnp.einsum("bthd,bshd->bhts", query, keys)
        # every layer's mask is the same computation: XLA computes it once
        mask = inputs.view.mask(inputs.visible, keys.shape[1])
        out = jnp.einsum("bhts,bshd->bthd", self._softmax(scores, mask), values)
        return out, written

    def _softmax(self, scores: jax.Array, mask: jax.Array) -> jax.Array:
        # HF: scale in the activation dtype, softmax in
        # fp32, probabilities back in the activation dtype.
        scores = (scores * self.config.softmax_scale).astype(jnp.float32)
        scores = jnp.where(mask[:, None], scores, -jnp.inf)
        return jax.nn.softmax(scores, axis=-1).astype(self.k_up.dtype)
