"""The six exact dispatches of a MoE layer's routed experts (``jaxdd.models.moe.MoE``).

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
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdd.models.quant import ExpertWeights, Int4Experts
from jaxdd.runtime.backend import Backend

Projections = Sequence[ExpertWeights]  # gate, up and down
Pieces = Sequence[tuple[jax.Array, ...]]  # each projection's stored pieces
Through = Callable[[jax.Array, jax.Array], jax.Array]  # (rows [P, D], chosen [P]) -> [P, D]


def grouped_experts(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
) -> jax.Array:
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


def pair_experts(
    projections: Projections, pieces: Pieces, backend: Backend, unplaced: bool = False
) -> Through:
    """(rows [P, D], chosen [P]) -> [P, D]: each row through its own expert. INT4 experts
    go through the backend's matvec kernel where it has one (CPU and GPU: unpacked in
    registers as the words are read; TPU: the chosen experts' blocks fetched and
    dequantized in VMEM); otherwise the chosen experts' pieces are gathered and then
    dequantized. ``unplaced``: the pieces lie on several devices outside ``shard_map``."""
    kernel = int4_kernel(projections, backend, unplaced)
    if kernel is None:
        # so XLA:GPU and XLA:TPU fuse the gather, for groups their kernels lack
        shifts = backend.platform != "cpu"
        return functools.partial(
            gathered_pairs, projections=projections, pieces=pieces, shifts=shifts
        )
    gate, up, down = pieces  # (packed, scale) each

    def through(rows: jax.Array, chosen: jax.Array) -> jax.Array:
        hidden = jax.nn.silu(kernel(rows, *gate, chosen)) * kernel(rows, *up, chosen)
        return kernel(hidden, *down, chosen)

    return through


def int4_kernel(
    projections: Projections, backend: Backend, unplaced: bool = False
) -> Callable[..., jax.Array] | None:
    """The backend's INT4 matvec kernel if it has one (for pieces ``unplaced`` or not: see
    ``Backend.int4_matvec``) and all three projections are INT4 in one group size it takes."""
    groups = {p.group if isinstance(p, Int4Experts) else None for p in projections}
    if len(groups) == 1 and None not in groups:
        return backend.int4_matvec(groups.pop(), unplaced)
    return None


def gathered_experts(
    x: jax.Array, weights: jax.Array, experts: jax.Array, through: Through
) -> jax.Array:
    """Each (token, slot) pair through its own expert (``through``, from
    ``pair_experts``: the chosen experts' stored bytes read once per pair);
    fp32 [N, D]. For few pairs: an expert chosen by two tokens is read twice."""
    n, k = experts.shape
    out = through(jnp.repeat(x, k, axis=0), experts.reshape(-1))  # pair p: token p // k
    return jnp.einsum("nkd,nk->nd", out.reshape(n, k, -1).astype(jnp.float32), weights)


def gathered_local_pairs(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    mine: jax.Array,
    capacity: int,
    through: Through,
) -> jax.Array:
    """``gathered_experts`` on one device under EP, where only the pairs routed to its
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
        return gathered_experts(x, weights, experts, through)

    return jax.lax.cond(local.sum() <= capacity, compacted, every_pair)


def gathered_pairs(
    rows: jax.Array,
    chosen: jax.Array,
    projections: Projections,
    pieces: Pieces,
    shifts: bool = False,
) -> jax.Array:
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


def _one_expert(rows: jax.Array, projections: Projections, stored: Pieces) -> jax.Array:
    """One expert's SwiGLU on rows [N, D], its gate, up
    and down dequantized from their ``stored`` pieces."""
    gate, up, down = (p.dequantize(*s) for p, s in zip(projections, stored, strict=True))
    return (jax.nn.silu(rows @ gate) * (rows @ up)) @ down


def scanned_experts(
    x: jax.Array, weights: jax.Array, experts: jax.Array, projections: Projections, pieces: Pieces
) -> jax.Array:
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


def skipping_experts(
    x: jax.Array, weights: jax.Array, experts: jax.Array, projections: Projections, pieces: Pieces
) -> jax.Array:
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


def tiled_experts(
    x: jax.Array, weights: jax.Array, experts: jax.Array, projections: Projections, pieces: Pieces
) -> jax.Array:
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


def all_experts(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
) -> jax.Array:
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
