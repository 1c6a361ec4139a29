"""The drafter's training forward: every anchored block of a sequence in one row.

At inference a block sees its context's cached K/V and itself. In training a sequence has many
anchors; copying its cache for each would cost blocks x length. Here the blocks of a sequence
go through the drafter as one row of ``anchors x B`` tokens over the sequence's single cache,
and the attention (``packed_attention``) lets block a see the cached tokens before its anchor
and its own B tokens only: the same view as at inference, with no copy of the cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxdd.cache import DraftCache
from jaxdd.models.drafter import DFlashDrafter
from jaxdd.models.target import KimiTarget
from pallas_kernels.tree_operands import TreeOperands


def packed_attention(
    ops: TreeOperands, *, scale: float, anchors: jax.Array, block: int
) -> jax.Array:
    """The drafter's attention [R, A*B, g, hd] for rows of ``A`` packed blocks of ``block``
    tokens (a tree-attention kernel's operands, each KV head a row): a query of block a sees
    the cached slots before ``anchors`` [R, A] and the keys of its own block."""
    # the drafter's latent queries are zero (keys ride as rope), and its one-block view
    # (length, tail_mask) gives way to the anchors' view
    q = ops.q_rope
    own = jnp.arange(q.shape[1]) // block
    context = jnp.einsum("rqgh,rsh->rgqs", q, ops.cache_rope) * scale
    seen = jnp.arange(ops.cache_rope.shape[1])[None, None, :] < anchors[:, own, None]
    context = jnp.where(seen[:, None], context, -jnp.inf)
    tail = jnp.einsum("rqgh,rsh->rgqs", q, ops.tail_rope) * scale
    tail = jnp.where((own[:, None] == own[None, :])[None, None], tail, -jnp.inf)
    probs = jax.nn.softmax(jnp.concatenate([context, tail], -1).astype(jnp.float32), -1)
    slots = ops.cache_rope.shape[1]
    out = jnp.einsum("rgqs,rsh->rqgh", probs[..., :slots], ops.cache_latent)
    return out + jnp.einsum("rgqs,rsh->rqgh", probs[..., slots:], ops.tail_latent)


def block_logits(
    drafter: DFlashDrafter, target: KimiTarget, tokens, features, anchors
) -> tuple[jax.Array, jax.Array]:
    """(draft logits [N*A, B-1, V], labels [N*A, B-1]) for the blocks anchored at ``anchors``
    [N, A] in tokens [N, T], each seeing the frozen target's features [N, T, K*D] of the tokens
    before its anchor (KV injection, as at inference)."""
    n, t = tokens.shape
    per_sequence = anchors.shape[1]
    block = drafter.config.block_size
    cache = DraftCache.zeros(drafter.config, n, t, drafter.dtype)
    positions = jnp.broadcast_to(jnp.arange(t), (n, t))
    cache = drafter.inject(cache, features, positions, jnp.zeros((n,), jnp.int32))
    bonus = jnp.take_along_axis(tokens, anchors, 1).reshape(-1)
    embeds = drafter.block_embeds(target, bonus, block).reshape(n, per_sequence * block, -1)
    positions = (anchors[:, :, None] + jnp.arange(block)).reshape(n, -1)
    kv = drafter.config.num_key_value_heads
    kernel = functools.partial(packed_attention, anchors=jnp.repeat(anchors, kv, 0), block=block)
    full = jnp.full((n,), per_sequence * block, jnp.int32)
    hidden, _ = drafter(embeds, positions, cache, full, kernel)
    logits = drafter.readout(target, hidden.reshape(n * per_sequence, block, -1)[:, 1:])
    offsets = anchors.reshape(-1, 1) + jnp.arange(1, block)
    labels = tokens[jnp.repeat(jnp.arange(n), per_sequence)[:, None], offsets]
    return logits, labels
