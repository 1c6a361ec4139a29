"""DDTree draft trees: the paper's best-first builder (host
oracle), its vectorized device twin, and the accept walk.

A node is a path of per-depth ranks (r1, ..., rd) into the drafter's top-k at each depth; its
score is the sum of those ranks' log-probabilities (log-softmax over the full vocabulary,
fp32). The paper (liranringel/ddtree ``build_ddtree_tree``) pops nodes from a heap, best
score first, ties broken by the rank tuple, until ``budget`` nodes are out. Since a child
never scores above its parent nor a sibling above its elder sibling, that pop order is simply
"descending score, ties by rank tuple" over all nodes, and the best ``budget`` nodes at depth
d are children of the best ``budget`` at depth d-1. The device build uses exactly that: a
beam of width ``budget`` per depth, then one sort over all beams. Scores are fp32 running
sums (parent + log-prob), which keeps the order monotone; the oracle reproduces the paper's
float64 incremental arithmetic, so the two agree unless two competing scores lie within float
rounding of each other (see tests/decoding/test_tree.py for the stated tolerance).

Trees are laid out with the root (the bonus token) at index 0 and nodes
1..budget in pop order, so a parent's index is always below its children's.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class DraftTree:
    tokens: jax.Array  # [B, N] int32, N = budget + 1; tokens[:, 0] is the root (the bonus token)
    parents: jax.Array  # [B, N] int32; the root's parent is 0 (itself)
    depths: jax.Array  # [B, N] int32; root depth 0
    valid: jax.Array  # [B, N] bool; False for padding when fewer than ``budget`` nodes exist
    visible: jax.Array  # [B, N, N] bool: visible[i, j] iff j is an ancestor of i or i itself


def tree_log_probs(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Top-k log-probabilities [..., L, k] (fp32, full-vocabulary logsumexp) and their tokens."""
    logits = logits.astype(jnp.float32)
    values, tokens = jax.lax.top_k(logits, k)  # ties: lower token id first
    return values - jax.nn.logsumexp(logits, axis=-1, keepdims=True), tokens.astype(jnp.int32)


def build_tree(
    draft_logits: jax.Array,
    bonus: jax.Array,
    depth_limit: jax.Array,
    budget: int,
    max_children: int | None = None,
) -> DraftTree:
    """Trees for a batch: draft_logits [B, L, V] of the L
    draft positions, bonus [B], depth_limit [B] (<= L).

    ``max_children`` caps the top-k per depth (1 gives
    the DFlash chain); by default k = min(budget, V).
    """
    vocab = draft_logits.shape[-1]
    k = min(budget, vocab, max_children or budget)
    lp, top_tokens = tree_log_probs(draft_logits, k)
    build = jax.vmap(lambda lp, tok, limit: _build_one(lp, tok, limit, budget))
    tokens, parents, depths, valid = build(lp, top_tokens, depth_limit)
    tokens = jnp.concatenate([bonus[:, None].astype(jnp.int32), tokens], axis=1)
    return DraftTree(tokens, parents, depths, valid, ancestor_mask(parents, draft_logits.shape[1]))


def _build_one(lp: jax.Array, top_tokens: jax.Array, depth_limit: jax.Array, budget: int):
    """One tree from top-k log-probs lp [L, k]: (tokens
    [budget], parents/depths/valid [budget + 1])."""
    depth_count, k = lp.shape
    width = budget  # beam width per depth: the best ``budget`` nodes of each depth
    slots = jnp.arange(width)
    # Depth 1: the k ranks, in rank (= lexicographic) order.
    score = jnp.where(slots < k, jnp.pad(lp[0], (0, width - k)), -jnp.inf)
    valid = (slots < k) & (depth_limit >= 1)
    ranks = jnp.full((width, depth_count), -1, jnp.int32).at[:, 0].set(slots)
    parent_slot = jnp.zeros((width,), jnp.int32)
    levels = [(score, valid, ranks, parent_slot)]
    for d in range(1, depth_count):
        prev_score, prev_valid, prev_ranks, _ = levels[-1]
        # Every (parent slot, rank) pair; beam slots are kept in rank-tuple order,
        # so the flat index slot * k + rank is the lexicographic order, which is
        # how top_k breaks ties (lower index first). One top_k per depth instead
        # of sorting candidates: a GPU runs it as one kernel, a sort as several.
        cand_valid = prev_valid[:, None] & (d < depth_limit)
        cand_score = jnp.where(cand_valid, prev_score[:, None] + lp[d][None, :], -jnp.inf).reshape(
            -1
        )
        chosen = jnp.sort(jax.lax.top_k(cand_score, width)[1])
        parent_slot = chosen // k
        rank = chosen % k
        ranks = prev_ranks[parent_slot].at[:, d].set(rank)
        score = prev_score[parent_slot] + lp[d][rank]
        levels.append((score, prev_valid[parent_slot] & (d < depth_limit), ranks, parent_slot))

    score, valid, ranks, parent_slot = (jnp.concatenate(x) for x in zip(*levels, strict=True))
    depth = jnp.repeat(jnp.arange(depth_count), width)
    # Pop order: valid first, descending score, then the
    # rank tuple (shorter prefix first: padding is -1).
    keys = [ranks[:, d] for d in reversed(range(depth_count))] + [_order_key(score, valid)]
    order = jnp.lexsort(keys)[:budget]
    node_index = (
        jnp.zeros((depth_count * width,), jnp.int32).at[order].set(jnp.arange(1, budget + 1))
    )
    level_parent = jnp.where(depth > 0, (depth - 1) * width + parent_slot, 0)
    parents = jnp.where(depth[order] > 0, node_index[level_parent[order]], 0)
    node_valid = valid[order]
    tokens = top_tokens[depth[order], ranks[order, depth[order]]]
    root = jnp.zeros((1,), jnp.int32)
    return (
        tokens,
        jnp.concatenate([root, jnp.where(node_valid, parents, 0)]),
        jnp.concatenate([root, jnp.where(node_valid, depth[order] + 1, 0)]),
        jnp.concatenate([jnp.ones((1,), bool), node_valid]),
    )


def _order_key(score: jax.Array, valid: jax.Array) -> jax.Array:
    """Ascending sort key for "valid first, best score first"."""
    return jnp.where(valid, -score, jnp.inf)


def ancestor_mask(parents: jax.Array, max_depth: int) -> jax.Array:
    """[B, N, N] ancestor-or-self mask from parents [B, N] (root's parent
    = itself), by pointer jumping: each step adds the rows of the 2^s-th
    ancestor, doubling the levels covered, so log2(max_depth) steps."""
    n = parents.shape[-1]
    visible = jax.nn.one_hot(jnp.arange(n), n, dtype=bool) | jax.nn.one_hot(parents, n, dtype=bool)
    jump = parents
    reach = 1
    while reach < max_depth:
        # rows of the 2^s-th ancestor
        visible |= jnp.take_along_axis(visible, jump[..., None], axis=-2)
        jump = jnp.take_along_axis(jump, jump, axis=-1)
        reach *= 2
    return visible


def accept_path(
    tree: DraftTree, posterior: jax.Array, max_depth: int
) -> tuple[jax.Array, jax.Array]:
    """Greedy walk: from the root, descend into the child
    whose token is the target's choice at the parent.

    posterior [B, N]: the target's token at each node. Returns the accepted path's node indices
    [B, max_depth + 1] (entries past its end point at the root) and the number of accepted
    drafts [B]. Sibling tokens are distinct, so at most one node per depth lies on the path.
    """
    matches = (tree.tokens == jnp.take_along_axis(posterior, tree.parents, axis=-1)) & tree.valid
    matches = matches.at[:, 0].set(True)
    # every ancestor matched its parent's choice
    on_path = ~(tree.visible & ~matches[:, None, :]).any(-1)
    accepted = jnp.where(on_path, tree.depths, 0).max(-1)
    depth_slots = jnp.arange(max_depth + 1)[None, :, None]
    at_depth = on_path[:, None, :] & (tree.depths[:, None, :] == depth_slots)  # [B, depth, node]
    return jnp.argmax(at_depth, axis=-1).astype(jnp.int32), accepted


# --------------------------------------------------------------------------------------------------
# Host oracle: the paper's heap, with its float64 incremental arithmetic


class HostTree(NamedTuple):
    tokens: np.ndarray  # [n] node tokens in pop order (root excluded)
    depths: np.ndarray  # [n] 1-based
    parents: np.ndarray  # [n + 1]; parents[0] = -1, node i+1's parent index (0 = root)
    scores: np.ndarray  # [n] float64 scores as the heap computed them


def build_tree_host(logits: np.ndarray, budget: int, max_children: int | None = None) -> HostTree:
    """liranringel/ddtree ``build_ddtree_tree`` on logits
    [L, V] (numpy), for tests and cross-checks."""
    logits = np.asarray(logits, np.float32)
    depth_limit, vocab = logits.shape
    if budget <= 0 or depth_limit == 0:
        return HostTree(np.zeros(0, np.int64), np.zeros(0, np.int64), np.array([-1]), np.zeros(0))
    k = min(budget, vocab, max_children or budget)
    # ties: lower token id first, as lax.top_k
    order = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    top = np.take_along_axis(logits, order, axis=-1)
    shifted = logits - logits.max(-1, keepdims=True)
    lse = (np.log(np.exp(shifted).sum(-1, dtype=np.float32)) + logits.max(-1)).astype(np.float32)
    lp = (top - lse[:, None]).astype(np.float32).astype(np.float64)

    tokens = []
    depths = []
    parents = [-1]
    scores = []
    heap = [(-lp[0, 0], (0,), 0, 1, 0, lp[0, 0])]
    while heap and len(tokens) < budget:
        _, ranks, parent, depth, rank, logw = heapq.heappop(heap)
        tokens.append(int(order[depth - 1, rank]))
        depths.append(depth)
        parents.append(parent)
        scores.append(logw)
        index = len(tokens)
        if rank + 1 < k:
            sibling = logw - lp[depth - 1, rank] + lp[depth - 1, rank + 1]
            heapq.heappush(
                heap, (-sibling, (*ranks[:-1], rank + 1), parent, depth, rank + 1, sibling)
            )
        if depth < depth_limit:
            child = logw + lp[depth, 0]
            heapq.heappush(heap, (-child, (*ranks, 0), index, depth + 1, 0, child))
    return HostTree(np.array(tokens), np.array(depths), np.array(parents), np.array(scores))
