"""The DFlash drafter (z-lab ``DFlashDraftModel``) in Flax NNX.

A stack of Qwen3-style layers without embedding or head: the block ``[bonus, MASK x (B-1)]`` is
embedded with the target's embedding and its outputs go through the target's lm_head. The target's
tapped hidden states of committed tokens enter as extra keys and values ("KV injection"):
``hidden_norm(fc(features))`` is projected by each layer's k/v projections (no input_layernorm on
it) and cached once, at the tokens' absolute positions. Block queries attend to all cached context
and to the whole block (non-causal); the block's own K/V is never committed to the cache.

Given a tree-attention kernel (``kernel``: the verify's, ``Backend.attention_kernel``: the Pallas
one, or on one CPU device the C++ one), the block's attention runs in it: the context K/V read once
through the page tables, with no scores in memory (XLA gathers a row's pages and writes every
layer's scores and probabilities).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxdd.cache import CacheView, DraftCache
from jaxdd.cache.draft import heads_as_rows
from jaxdd.cache.layout import stored
from jaxdd.config import DrafterConfig
from jaxdd.models.layers import (
    MLP,
    RMSNorm,
    apply_rope,
    param,
    project_heads,
    rope_cos_sin,
    rope_frequencies,
    unmerged,
)
from jaxdd.runtime.sharding import AXIS, Placeable, partition_spec
from pallas_kernels.tree_operands import TreeOperands


class DraftAttention(nnx.Module, Placeable):
    def __init__(self, config: DrafterConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.placement = None  # (mesh, mode) once placed by ``jaxdd.runtime.sharding.shard_module``
        self.q_proj = param(
            rngs,
            (c.hidden_size, c.num_attention_heads, c.head_dim),
            dtype,
            ("embed", "heads", None),
        )
        self.k_proj = param(
            rngs,
            (c.hidden_size, c.num_key_value_heads, c.head_dim),
            dtype,
            ("embed", "kv_heads", None),
        )
        self.v_proj = param(
            rngs,
            (c.hidden_size, c.num_key_value_heads, c.head_dim),
            dtype,
            ("embed", "kv_heads", None),
        )
        self.o_proj = param(
            rngs,
            (c.num_attention_heads, c.head_dim, c.hidden_size),
            dtype,
            ("heads", None, "embed"),
        )
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, axis=None)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, axis=None)

    def keys_values(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """[B,T,D] -> normed, rotated keys and values
        [B,kv_heads,T,head_dim] (the cache's layout)."""
        # Projected as the weights are stored, then the few new rows transposed: projecting
        # straight into the cache's layout makes XLA:CPU relay out both weights on every call.
        k = self.k_norm(jnp.einsum("btd,dkh->btkh", *unmerged(x, self.k_proj[...])))
        v = jnp.einsum("btd,dkh->btkh", *unmerged(x, self.v_proj[...]))
        k = apply_rope(k, cos[:, :, None], sin[:, :, None], interleaved=False)
        return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def __call__(
        self,
        x: jax.Array,
        cos_sin: tuple[jax.Array, jax.Array],
        cached: tuple[jax.Array, jax.Array],
        view: CacheView,
        block_len: jax.Array,
        kernel: Callable | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """x [B,T,D]; cached keys/values (rows [B,kv,S,hd] or pools of pages) holding the
        context ``view`` reads; the block sees it and its own first ``block_len`` [B] tokens.
        Returns the output [B,T,D] and the keys/values, with the block's rows in them unless
        ``kernel`` (the tree-attention kernel) attends.

        Without the kernel the block's K/V are written where ``view`` writes new rows, so
        attention runs over the cache alone (no concatenated copy of it per layer). They are
        never committed: the view does not move, the slots stay hidden from later blocks beyond
        their own, and the next context injection overwrites them.
        """
        c = self.config
        cos, sin = cos_sin
        q = self.q_norm(jnp.einsum("btd,dnh->btnh", *unmerged(x, self.q_proj[...])))
        q = apply_rope(q, cos[:, :, None], sin[:, :, None], interleaved=False)
        k, v = self.keys_values(x, cos, sin)
        if kernel is not None:
            # the block's K/V as the cache stores them, as the XLA form reads them back
            k, v = (stored(y, cached[0].dtype) for y in (k, v))
            out = self._kernel_attention(kernel, q, k, v, cached, view, block_len)
            return project_heads(out.astype(x.dtype), self.o_proj[...]), cached
        written = tuple(map(view.write, cached, (k, v)))
        keys, values = (view.read(w).astype(q.dtype) for w in written)  # 8-bit K/V widened
        mask = view.committed(keys.shape[view.axis], extra=block_len)
        b, t = x.shape[:2]
        groups = c.num_attention_heads // c.num_key_value_heads
        q = q.reshape(b, t, c.num_key_value_heads, groups, c.head_dim)
        scores = jnp.einsum("btkgh,bksh->bkgts", q, keys).astype(jnp.float32) * c.head_dim**-0.5
        scores = jnp.where(mask[:, None, None, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        # Values first, as the target's absorbed attention does: this order has XLA:CPU read both
        # caches as stored (no per-layer copies in the compiled round).
        out = jnp.einsum("bksh,bkgts->btkgh", values, probs).reshape(
            b, t, c.num_attention_heads, c.head_dim
        )
        return project_heads(out, self.o_proj[...]), written

    def _kernel_attention(self, kernel, q, k, v, cached, view: CacheView, block_len) -> jax.Array:
        """The block's attention [B,T,heads,hd] (fp32) in the tree-attention kernel, per device
        on its KV heads. The kernel is MLA's (scores q_latent . latent + q_rope . rope, values
        the latent): keys go in as its rope operand, values as its latent one, and zero latent
        queries leave the scores q . k. Each KV head is a row of its own
        (``jaxdd.cache.draft.heads_as_rows``: a request's table serves its KV heads' rows)."""

        def attend(q, k, v, cached, length, block_len, pages):
            b, t, heads, hd = q.shape  # this device's heads
            kv = k.shape[1]
            q = q.reshape(b, t, kv, heads // kv, hd).transpose(0, 2, 1, 3, 4)
            q = q.reshape(b * kv, t, heads // kv, hd)
            keys, values, k, v = map(heads_as_rows, (*cached, k, v))
            tail = jnp.arange(t)[None, None, :] < block_len[:, None, None]
            ops = TreeOperands(
                jnp.zeros_like(q),
                q,
                values,
                keys,
                jnp.repeat(length, kv),
                v,
                k,
                jnp.repeat(jnp.broadcast_to(tail, (b, t, t)), kv, axis=0),
                pages,
                fold=kv,
            )
            out = kernel(ops, scale=hd**-0.5)
            out = out.reshape(b, kv, t, heads // kv, hd).transpose(0, 2, 1, 3, 4)
            return out.reshape(b, t, heads, hd)

        operands = (q, k, v, cached, view.length, block_len, view.pages)
        if self.placement is None or self.placement[0].size == 1:
            return attend(*operands)
        # a Pallas kernel is opaque to XLA's partitioner: each device runs it on its KV heads
        # (all of them where the mesh does not split the KV heads)
        mesh = self.placement[0]
        c = self.config
        split = partition_spec((c.num_key_value_heads,), ("kv_heads",), mesh, "tp")[0]
        whole = PartitionSpec()
        by_heads = PartitionSpec(None, AXIS) if split else whole
        q_spec = PartitionSpec(None, None, AXIS) if split else whole
        specs = (q_spec, by_heads, by_heads, (by_heads, by_heads), whole, whole, whole)
        attend = jax.shard_map(attend, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)
        return attend(*operands)


class DraftLayer(nnx.Module):
    def __init__(self, config: DrafterConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.attn = DraftAttention(config, dtype, rngs)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, dtype, rngs)

    def __call__(self, x, cos_sin, cached, view: CacheView, block_len, kernel=None):
        attn, cached = self.attn(self.attn_norm(x), cos_sin, cached, view, block_len, kernel)
        x = x + attn
        return x + self.mlp(self.mlp_norm(x)), cached


class DFlashDrafter(nnx.Module):
    def __init__(self, config: DrafterConfig, dtype: jnp.dtype = jnp.bfloat16, *, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.dtype = dtype
        self.fc = param(
            rngs, (len(c.target_layer_ids) * c.hidden_size, c.hidden_size), dtype, (None, "embed")
        )
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.layers = nnx.List([DraftLayer(c, dtype, rngs) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)

    def _cos_sin(self, positions: jax.Array):
        c = self.config
        inv_freq, amplitude = rope_frequencies(c.head_dim, c.rope_theta, c.yarn)
        return rope_cos_sin(positions, inv_freq, amplitude, self.dtype)

    def inject(
        self, cache: DraftCache, features: jax.Array, positions: jax.Array, count: jax.Array
    ) -> DraftCache:
        """Cache the K/V of context tokens: features [B,C,K*D]
        (target taps) at positions [B,C]; commit count [B]."""
        context = self.hidden_norm(features.astype(self.dtype) @ self.fc[...])
        cos, sin = self._cos_sin(positions)
        keys = []
        values = []
        for layer, cached_keys, cached_values in zip(
            self.layers, cache.keys, cache.values, strict=True
        ):
            k, v = layer.attn.keys_values(context, cos, sin)
            keys.append(cache.view.write(cached_keys, k))
            values.append(cache.view.write(cached_values, v))
        committed = cache.view.commit(count).length
        kind = type(cache.keys)
        return cache.replace(keys=kind(keys), values=kind(values), length=committed)

    def __call__(
        self,
        embeds: jax.Array,
        positions: jax.Array,
        cache: DraftCache,
        block_len: jax.Array,
        kernel: Callable | None = None,
    ) -> tuple[jax.Array, DraftCache]:
        """Final-normed hidden states [B,T,D] for the block embeddings
        [B,T,D] at positions [B,T], and the cache (without ``kernel``: with the block's K/V in
        the uncommitted slots after the context, see ``DraftAttention``).

        Block keys at index >= block_len [B] are hidden (the
        reference drafts a shorter block near max length).
        """
        cos_sin = self._cos_sin(positions)
        x = embeds.astype(self.dtype)
        keys = []
        values = []
        for layer, cached in zip(
            self.layers, zip(cache.keys, cache.values, strict=True), strict=True
        ):
            x, (layer_keys, layer_values) = layer(x, cos_sin, cached, cache.view, block_len, kernel)
            keys.append(layer_keys)
            values.append(layer_values)
        kind = type(cache.keys)
        return self.norm(x), cache.replace(keys=kind(keys), values=kind(values))

    def draft_logits(
        self,
        target,
        cache: DraftCache,
        bonus: jax.Array,
        start: jax.Array,
        block_len: jax.Array,
        block: int,
        kernel: Callable | None = None,
    ) -> tuple[jax.Array, DraftCache]:
        """Draft logits [B, block-1, V] for positions start+1 ..: one forward over ``[bonus,
        MASK x (block-1)]`` (its attention in ``kernel`` if given), and the cache as that
        forward left it (keep it: its extra rows are uncommitted, and reusing the buffer lets a
        donated round write in place).

        The block is embedded with the target's embedding and read out through its lm_head.
        """
        positions = start[:, None] + jnp.arange(block)[None, :]
        hidden, cache = self(
            self.block_embeds(target, bonus, block), positions, cache, block_len, kernel
        )
        return self.readout(target, hidden[:, 1:]), cache

    def block_embeds(self, target, bonus: jax.Array, block: int) -> jax.Array:
        """The embeddings [B, block, D] of the blocks ``[bonus, MASK x (block-1)]`` (bonus [B])."""
        c = self.config
        masks = jnp.full((bonus.shape[0], block - 1), c.mask_token_id, jnp.int32)
        noise = jnp.concatenate([bonus[:, None], masks], axis=1)
        return target.embed_tokens(noise) * c.input_embedding_scale

    def readout(self, target, hidden: jax.Array) -> jax.Array:
        """Draft logits of final-normed hidden states, through the target's lm_head."""
        c = self.config
        logits = target.logits(hidden) * c.output_multiplier
        if c.final_logit_softcapping is not None:
            logits = jnp.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits


def abstract_drafter(config: DrafterConfig, dtype: jnp.dtype) -> tuple[nnx.GraphDef, nnx.State]:
    return nnx.split(nnx.eval_shape(lambda: DFlashDrafter(config, dtype, rngs=nnx.Rngs(0))))
