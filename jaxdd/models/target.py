"""The Kimi K2.x / DeepSeek-V3 target model in Flax NNX:
MLA attention over a latent cache and noaux_tc MoE.

One forward serves every use: prefill, one-token decode, a causal block (linear verify) and a draft
tree. The new tokens see the committed prefix of the cache plus whichever new tokens ``visible``
allows; their latent rows are written where the cache's view puts them (``jaxdd.cache``);
committing them (``LatentCache.commit``, or ``keep_path`` for an accepted tree path) is the
caller's job.

Weights use the JAX layout ``x @ W`` ([in, out]);
``jaxdd.weights.hf_mappings`` maps the HF names and transposes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdd.cache import CacheView, LatentCache
from jaxdd.config import KimiConfig
from jaxdd.models.attention import MLAttention
from jaxdd.models.layers import (
    MLP,
    RMSNorm,
    linear,
    param,
    rope_cos_sin,
    rope_frequencies,
)
from jaxdd.models.moe import MoE
from jaxdd.models.quant import DENSE, ExpertFormat
from jaxdd.runtime.backend import Backend
from jaxdd.runtime.sharding import AXIS, Placeable, partition_spec
from jaxdd.types import Attention


class TargetOutput(NamedTuple):
    hidden: jax.Array  # [B, T, D] after the final norm (feed to ``KimiTarget.logits``)
    # [B, T, len(taps) * D]: residual stream after each tapped layer, concatenated
    taps: jax.Array | None
    cache: LatentCache  # new rows written, ``length`` unchanged


def target_rope(config: KimiConfig) -> tuple[np.ndarray, float]:
    """(inv_freq, amplitude) of the MLA rope slice."""
    return rope_frequencies(config.qk_rope_head_dim, config.rope_theta, config.yarn)


class TargetLayer(nnx.Module):
    def __init__(
        self,
        config: KimiConfig,
        layer: int,
        dtype: jnp.dtype,
        experts: ExpertFormat,
        rngs: nnx.Rngs,
    ):
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.attn = MLAttention(config, dtype, rngs)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if config.is_moe_layer(layer):
            self.mlp = MoE(config, dtype, experts, rngs)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, dtype, rngs)

    def __call__(
        self,
        x,
        cos_sin,
        cache_rows,
        view: CacheView,
        visible,
        attention: Attention,
        backend: Backend,
    ):
        attn, cache_rows = self.attn(
            self.attn_norm(x), cos_sin, cache_rows, view, visible, attention, backend
        )
        x = x + attn
        mlp_in = self.mlp_norm(x)
        return x + self.mlp(mlp_in, backend), cache_rows


class KimiTarget(nnx.Module, Placeable):
    def __init__(
        self,
        config: KimiConfig,
        dtype: jnp.dtype = jnp.bfloat16,
        *,
        experts: ExpertFormat = DENSE,
        rngs: nnx.Rngs,
    ):
        self.config = config
        self.dtype = dtype
        self.experts = experts  # how routed-expert weights are stored
        # (mesh, "tp" | "ep") once placed by ``jaxdd.runtime.sharding.shard_module``
        self.placement = None
        self.embed = param(rngs, (config.vocab_size, config.hidden_size), dtype, ("vocab", "embed"))
        layers = [
            TargetLayer(config, i, dtype, experts, rngs) for i in range(config.num_hidden_layers)
        ]
        self.layers = nnx.List(layers)
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = param(
            rngs, (config.hidden_size, config.vocab_size), dtype, ("embed", "vocab")
        )

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: LatentCache,
        visible: jax.Array,
        *,
        taps: tuple[int, ...] = (),
        attention: Attention = "absorbed",
        backend: Backend,
    ) -> TargetOutput:
        """tokens, positions [B, T] int32; visible [B, T,
        T] bool: may new token i attend to new token j.

        Causal ``visible`` gives prefill / decode / linear verify; an
        ancestor-or-self mask gives tree verify (with positions = start +
        depth). ``backend``: the platform's choices (``Backend.of_module``).
        """
        inv_freq, amplitude = target_rope(self.config)
        cos_sin = rope_cos_sin(positions, inv_freq, amplitude, self.dtype)

        x = self.embed_tokens(tokens)
        latent_cache = list(cache.latent)
        rope_cache = list(cache.rope)
        tapped = []
        for i, layer in enumerate(self.layers):
            rows = (latent_cache[i], rope_cache[i])
            x, (latent_cache[i], rope_cache[i]) = layer(
                x, cos_sin, rows, cache.view, visible, attention, backend
            )
            if i in taps:
                tapped.append(x)
        by_layer = dict(zip(sorted(set(taps)), tapped, strict=True))
        tap_out = jnp.concatenate([by_layer[i] for i in taps], axis=-1) if taps else None
        kind = type(cache.latent)  # a prompt's tuple or a Pool
        new_cache = cache.replace(latent=kind(latent_cache), rope=kind(rope_cache))
        return TargetOutput(self.final_norm(x), tap_out, new_cache)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """Embedding rows for token ids. Vocab-parallel on a mesh: each device
        looks up the ids in its slice of the table, zeros the rest, and the
        slices are summed (a plain gather would all-gather the table)."""
        table = self.embed[...]
        if (
            self.placement is None
            or partition_spec(table.shape, ("vocab", "embed"), *self.placement)[0] != AXIS
        ):
            return table[tokens]
        mesh, _ = self.placement
        rows = self.config.vocab_size // mesh.shape[AXIS]

        def local(table, tokens):
            ids = tokens - jax.lax.axis_index(AXIS) * rows
            mine = (ids >= 0) & (ids < rows)
            return jax.lax.psum(jnp.where(mine[..., None], table[jnp.where(mine, ids, 0)], 0), AXIS)

        specs = (jax.sharding.PartitionSpec(AXIS), jax.sharding.PartitionSpec())
        return jax.shard_map(
            local, mesh=mesh, in_specs=specs, out_specs=jax.sharding.PartitionSpec()
        )(table, tokens)

    def logits(self, hidden: jax.Array, backend: Backend | None = None) -> jax.Array:
        """fp32 logits for final hidden states (the untied lm_head)."""
        return linear(hidden, self.lm_head[...], backend).astype(jnp.float32)


def abstract_target(
    config: KimiConfig, dtype: jnp.dtype, experts: ExpertFormat = DENSE
) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's structure and its parameter shapes/dtypes,
    without allocating (for loading and restoring)."""
    return nnx.split(
        nnx.eval_shape(lambda: KimiTarget(config, dtype, experts=experts, rngs=nnx.Rngs(0)))
    )
