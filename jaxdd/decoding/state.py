"""What a round runs on: its static spec (one compiled executable each), the models as
jit-able weights, the per-row request settings, and the decode state the rounds donate
(``jaxdd.decoding.rounds``), with where that state lives on a mesh."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jaxdd.cache import DraftCache, LatentCache, Paging
from jaxdd.cache.draft import kv_dtype
from jaxdd.cache.stripes import Stripes
from jaxdd.config import DrafterConfig, KimiConfig
from jaxdd.decoding.sampling import SamplingArrays
from jaxdd.models.drafter import DFlashDrafter
from jaxdd.models.target import KimiTarget
from jaxdd.runtime.backend import Backend
from jaxdd.runtime.jit_state import ModuleStructure
from jaxdd.runtime.sharding import cache_sharding
from jaxdd.types import Attention, DrafterKV, Method, TreeLogits


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoundSpec:
    """Everything static about a round: one compiled executable per spec (and array shapes)."""

    method: Method
    backend: Backend
    block: int = 1  # tokens per draft block, the bonus included; 1 for AR
    budget: int | None = None  # DDTree: tree nodes per round
    # DDTree: cap on the branching (1 verifies the DFlash chain as a tree)
    max_children: int | None = None
    attention: Attention = "absorbed"  # the verify's MLA form
    sampled: bool = False  # compile the sampling path (greedy rows still decode greedily)
    # > 0: also report the drafter's top-``trace`` tokens per position (and DDTree's tree)
    trace: int = 0
    # sampled DDTree: the tree from the draft logits at the temperature, or raw
    tree_logits: TreeLogits = "scaled"
    # > 0: also report each emitted token's logprob and the top-``top_logprobs`` at its position
    top_logprobs: int = 0
    stripes: Stripes | None = None  # how the latent cache is striped (None: replicated)
    drafter_kv: DrafterKV = "model"  # the dtype the drafter's context K/V is stored in

    @property
    def width(self) -> int:
        """Tokens a round emits per row (its report's ``tokens``): 1 for AR, else the block."""
        return 1 if self.method == "ar" else self.block


@struct.dataclass
class ModelPair:
    """The target (and drafter) as static structure + weight
    arrays (``jaxdd.runtime.jit_state``), merged in the jit."""

    target_weights: list[jax.Array]
    drafter_weights: list[jax.Array] | None
    target_structure: ModuleStructure = struct.field(pytree_node=False)
    drafter_structure: ModuleStructure | None = struct.field(pytree_node=False)

    def merge(self) -> tuple[KimiTarget, DFlashDrafter | None]:
        drafter = (
            None
            if self.drafter_structure is None
            else self.drafter_structure.merge(self.drafter_weights)
        )
        return self.target_structure.merge(self.target_weights), drafter


@struct.dataclass
class RowSettings:
    """Per-row request settings, on the device once for all rounds."""

    max_length: jax.Array  # [rows] int32: prompt length + max_new_tokens
    stop_ids: jax.Array  # [rows, MAX_STOP_TOKENS] int32, -1 padded
    sampling: SamplingArrays
    # [rows, row_pages] int32: the pages each row holds (``jaxdd.cache.pages``), read by both
    # caches; the host's tables, so a row given back reaches no page from the next round on
    pages: jax.Array
    # [rows] bool: rows that wait this round for pages (their state as before it, random
    # stream and drafter context included, so they decode on as if the round had not run)
    paused: jax.Array


@struct.dataclass
class DecodeState:
    target_cache: LatentCache
    # [B] int32: the newest token, at position target_cache.length, not in the cache yet
    bonus: jax.Array
    # [B] bool: the request stopped or reached its length; its row no longer changes
    done: jax.Array
    rng: jax.Array  # [B, 2] uint32: each request's random stream (sampled ones)
    draft_cache: DraftCache | None = None
    # [B, block, taps * D]: features of the tokens committed last round
    context: jax.Array | None = None
    context_count: jax.Array | None = None  # [B] int32: how many rows of ``context`` are real

    @classmethod
    def empty(
        cls,
        config: KimiConfig,
        drafter_config: DrafterConfig | None,
        batch: int,
        paging: Paging,
        block: int,
        dtype: jnp.dtype,
        rng: jax.Array,
        stripes: Stripes | None = None,
        drafter_kv: DrafterKV = "model",
    ) -> DecodeState:
        """The state before the prefill: empty pools paged as ``paging`` says for ``batch`` rows
        (and drafter context, with a drafter, its K/V stored as
        ``drafter_kv`` says)."""
        drafter = {}
        if drafter_config is not None:
            features = len(drafter_config.target_layer_ids) * config.hidden_size
            drafter = {
                "draft_cache": DraftCache.pooled(
                    drafter_config, batch, paging, kv_dtype(drafter_kv, dtype)
                ),
                "context": jnp.zeros((batch, block, features), dtype),
                "context_count": jnp.zeros((batch,), jnp.int32),
            }
        return cls(
            target_cache=LatentCache.pooled(config, batch, paging, dtype, stripes),
            bonus=jnp.zeros((batch,), jnp.int32),
            done=jnp.zeros((batch,), bool),
            rng=rng,
            **drafter,
        )

    def with_pages(self, pages: jax.Array) -> DecodeState:
        """Both caches reading and writing through the page tables ``pages``."""
        state = self.replace(target_cache=self.target_cache.replace(pages=pages))
        if self.draft_cache is None:
            return state
        return state.replace(draft_cache=self.draft_cache.replace(pages=pages))


def state_shardings(state: DecodeState, mesh: jax.sharding.Mesh) -> DecodeState:
    """Where a decode state lives on a mesh: the latent rows replicated (every head reads
    them) or split along their slots (striped), the drafter's K/V split by KV heads, the rest
    replicated."""
    shardings = jax.tree.map(lambda x: cache_sharding(x.shape, (None,) * x.ndim, mesh), state)
    shardings = shardings.replace(target_cache=state.target_cache.shardings(mesh))
    if state.draft_cache is None:
        return shardings
    kv_axes = (None, "kv_heads", None, None)
    keys, values = (
        [cache_sharding(x.shape, kv_axes, mesh) for x in xs]
        for xs in (state.draft_cache.keys, state.draft_cache.values)
    )
    kind = type(state.draft_cache.keys)  # a Pool of pages
    return shardings.replace(
        draft_cache=shardings.draft_cache.replace(keys=kind(keys), values=kind(values))
    )
