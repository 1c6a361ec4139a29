"""The DFlash drafter (z-lab ``DFlashDraftModel``) in Flax NNX.

A stack of Qwen3-style layers without embedding or head: the block ``[bonus, MASK x (B-1)]`` is
embedded with the target's embedding and its outputs go through the target's lm_head. The target's
tapped hidden states of committed tokens enter as extra keys and values ("KV injection"):
``hidden_norm(fc(features))`` is projected by each layer's k/v projections (no input_layernorm on
it) and cached once, at the tokens' absolute positions. Block queries attend to all cached context
and to the whole block (non-causal); the block's own K/V is never committed to the cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdd.cache import CacheView, DraftCache
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


class DraftAttention(nnx.Module):
    def __init__(self, config: DrafterConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        c = config
        self.config = c
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
        self, x, cos_sin, cached: tuple[jax.Array, jax.Array], view: CacheView, mask: jax.Array
    ):
        """x [B,T,D]; cached keys/values (rows [B,kv,S,hd] or pools of pages) holding the
        context ``view`` reads; mask [B,S]: the slots the block sees. Returns the output [B,T,D]
        and the keys/values with the block's rows in them.

        The block's K/V are written where ``view`` writes new rows, so attention runs over
        the cache alone (no concatenated copy of it per layer). They are never committed:
        the view does not move, the slots stay hidden from later blocks beyond their own,
        and the next context injection overwrites them.
        """
        c = self.config
        cos, sin = cos_sin
        q = self.q_norm(jnp.einsum("btd,dnh->btnh", *unmerged(x, self.q_proj[...])))
        q = apply_rope(q, cos[:, :, None], sin[:, :, None], interleaved=False)
        k, v = self.keys_values(x, cos, sin)
        written = tuple(map(view.write, cached, (k, v)))
        keys, values = map(view.read, written)
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


class DraftLayer(nnx.Module):
    def __init__(self, config: DrafterConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.attn = DraftAttention(config, dtype, rngs)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, dtype, rngs)

    def __call__(self, x, cos_sin, cached, view: CacheView, mask):
        attn, cached = self.attn(self.attn_norm(x), cos_sin, cached, view, mask)
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
        self, embeds: jax.Array, positions: jax.Array, cache: DraftCache, block_len: jax.Array
    ) -> tuple[jax.Array, DraftCache]:
        """Final-normed hidden states [B,T,D] for the block embeddings
        [B,T,D] at positions [B,T], and the cache with the block's K/V in
        the uncommitted slots after the context (see ``DraftAttention``).

        Block keys at index >= block_len [B] are hidden (the
        reference drafts a shorter block near max length).
        """
        # context, then block
        visible = cache.visible(block_len)
        cos_sin = self._cos_sin(positions)
        x = embeds.astype(self.dtype)
        keys = []
        values = []
        for layer, cached in zip(
            self.layers, zip(cache.keys, cache.values, strict=True), strict=True
        ):
            x, (layer_keys, layer_values) = layer(x, cos_sin, cached, cache.view, visible)
            keys.append(layer_keys)
            values.append(layer_values)
        kind = type(cache.keys)
        return self.norm(x), cache.replace(keys=kind(keys), values=kind(values))

    def draft_logits(self, target, cache: DraftCache, bonus, start, block_len, block: int):
        """Draft logits [B, block-1, V] for positions start+1 ..: one forward over ``[bonus,
        MASK x (block-1)]``, and the cache as that forward left it (keep it: its extra rows
        are uncommitted, and reusing the buffer lets a donated round write in place).

        The block is embedded with the target's embedding and read out through its lm_head.
        """
        c = self.config
        masks = jnp.full((bonus.shape[0], block - 1), c.mask_token_id, jnp.int32)
        noise = jnp.concatenate([bonus[:, None], masks], axis=1)
        embeds = target.embed_tokens(noise) * c.input_embedding_scale
        hidden, cache = self(embeds, start[:, None] + jnp.arange(block)[None, :], cache, block_len)
        logits = target.logits(hidden[:, 1:]) * c.output_multiplier
        if c.final_logit_softcapping is not None:
            logits = jnp.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits, cache


def abstract_drafter(config: DrafterConfig, dtype: jnp.dtype) -> tuple[nnx.GraphDef, nnx.State]:
    return nnx.split(nnx.eval_shape(lambda: DFlashDrafter(config, dtype, rngs=nnx.Rngs(0))))
