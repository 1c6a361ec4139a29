"""jaxdd.cache: the views the models read and write through, and the table of rows."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DeepseekV3Config

from jaxdd.cache import CacheView, DraftCache, LatentCache, RowTable, row_slots
from jaxdd.cache.layout import Pool, front, put_front, put_rows, take_rows, write_rows
from jaxdd.config import DrafterConfig, KimiConfig
from jaxdd.errors import InvariantError
from jaxdd.testing.profiles import examples
from jaxdd.testing.reference import TINY_K2, drafter_config

TARGET = KimiConfig.from_hf(DeepseekV3Config(**TINY_K2).to_dict())
DRAFTER = DrafterConfig.from_hf(drafter_config())


@settings(max_examples=examples(25), deadline=None)
@given(
    batch=st.integers(1, 12),
    rows=st.integers(1, 5),
    heads=st.sampled_from([None, 2]),
    seed=st.integers(0, 2**16),
)
def test_write_rows_puts_each_sequence_at_its_start(batch, rows, heads, seed):
    """Unrolled in-place updates (batch <= 8) and the vmapped scatter (beyond)
    both write sequence b's rows at its own start, for the latent layout [B,
    S, d] (slot axis 1) and the drafter's [B, kv, S, hd] (axis 2)."""
    rng = np.random.default_rng(seed)
    slots = 16
    axis = 1 if heads is None else 2
    lead = () if heads is None else (heads,)
    buffer = rng.normal(size=(batch, *lead, slots, 3)).astype(np.float32)
    new = rng.normal(size=(batch, *lead, rows, 3)).astype(np.float32)
    start = rng.integers(0, slots - rows + 1, batch).astype(np.int32)
    expected = np.moveaxis(buffer.copy(), axis, 1)
    for b in range(batch):
        expected[b, start[b] : start[b] + rows] = np.moveaxis(new, axis, 1)[b]
    expected = np.moveaxis(expected, 1, axis)
    written = write_rows(jnp.asarray(buffer), jnp.asarray(new), jnp.asarray(start), axis)
    np.testing.assert_array_equal(np.asarray(written), expected)
    view = CacheView(jnp.asarray(start), axis=axis)
    np.testing.assert_array_equal(np.asarray(view.write(jnp.asarray(buffer), new)), expected)


@settings(max_examples=examples(25), deadline=None)
@given(batch=st.integers(1, 3), new=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_the_mask_is_committed_slots_and_visible_new_ones(batch, new, seed):
    """Slot s is visible to new token i iff it is committed, or it holds new token
    j = s - length and ``visible[i, j]``; slots past the new tokens never are."""
    rng = np.random.default_rng(seed)
    slots = 12
    length = rng.integers(0, slots - new + 1, batch)
    visible = rng.random((batch, new, new)) < 0.5
    mask = np.asarray(CacheView(jnp.asarray(length, jnp.int32)).mask(jnp.asarray(visible), slots))
    for b in range(batch):
        for i in range(new):
            for s in range(slots):
                j = s - length[b]
                expected = s < length[b] or (0 <= j < new and visible[b, i, j])
                assert mask[b, i, s] == expected, (b, i, s)
    committed = np.asarray(CacheView(jnp.asarray(length, jnp.int32)).committed(slots))
    np.testing.assert_array_equal(committed, np.arange(slots)[None] < length[:, None])


def test_keep_path_moves_the_accepted_rows_and_commit_keeps_them():
    """A tree path's rows (increasing node indices) move to the first new slots of
    their row; committing ``count`` of them moves the length; the rest is untouched."""
    config = TARGET
    cache = LatentCache.zeros(config, 2, 16, jnp.float32)
    rng = np.random.default_rng(0)
    latent = [rng.normal(size=x.shape).astype(np.float32) for x in cache.latent]
    cache = cache.replace(
        latent=tuple(map(jnp.asarray, latent)), length=jnp.asarray([3, 5], jnp.int32)
    )
    path = jnp.asarray([[0, 2, 5], [0, 1, 4]], jnp.int32)
    kept = cache.keep_path(path).commit(jnp.asarray([3, 2], jnp.int32))
    np.testing.assert_array_equal(np.asarray(kept.length), [6, 7])
    for before, after in zip(latent, kept.latent, strict=True):
        expected = before.copy()
        for b, start in enumerate((3, 5)):
            expected[b, start : start + 3] = before[b, start + np.asarray(path[b])]
        np.testing.assert_array_equal(np.asarray(after), expected)


def test_fill_puts_a_prompt_cache_first_and_commits_its_length():
    config = TARGET
    prompt = LatentCache.zeros(config, 2, 4, jnp.float32)
    prompt = prompt.replace(latent=tuple(x + 1.0 for x in prompt.latent))
    filled = LatentCache.zeros(config, 2, 16, jnp.float32).fill(prompt, jnp.asarray([4, 2]))
    np.testing.assert_array_equal(np.asarray(filled.length), [4, 2])
    rows = np.asarray(filled.latent[0])
    assert (rows[:, :4] == 1).all() and (rows[:, 4:] == 0).all()


def test_a_drafted_block_sees_the_context_and_its_own_first_rows():
    cache = DraftCache.zeros(DRAFTER, 2, 8, jnp.float32)
    cache = cache.replace(length=jnp.asarray([2, 5], jnp.int32))
    visible = np.asarray(cache.view.committed(cache.slots, extra=jnp.asarray([3, 1], jnp.int32)))
    np.testing.assert_array_equal(visible.sum(1), [5, 6])
    assert cache.view.axis == 2


def test_rows_are_placed_and_read_back_by_index():
    pool = Pool((jnp.arange(6.0),))  # no row axis: placement leaves it whole
    batch = {"a": jnp.zeros((4, 3)), "b": jnp.zeros((4,), jnp.int32), "pool": pool}
    one = {"a": jnp.ones((1, 3)), "b": jnp.full((1,), 7, jnp.int32), "pool": Pool((pool[0] + 1,))}
    placed = put_rows(batch, one, jnp.asarray([2]))
    np.testing.assert_array_equal(np.asarray(placed["b"]), [0, 0, 7, 0])
    np.testing.assert_array_equal(placed["pool"][0], pool[0] + 1)  # the part's, after it ran
    assert take_rows(placed, jnp.asarray([2, 0]))["b"].tolist() == [7, 0]
    part = front(placed, 3)
    assert part["a"].shape == (3, 3) and part["pool"][0].shape == (6,)
    back = put_front(batch, jax_tree_plus_one(part))
    np.testing.assert_array_equal(np.asarray(back["b"]), [1, 1, 8, 0])


def jax_tree_plus_one(tree):
    return {k: v if isinstance(v, Pool) else v + 1 for k, v in tree.items()}


def test_the_table_gives_the_lowest_free_row_and_takes_it_back():
    table: RowTable[str] = RowTable(3)
    assert [table.take("a"), table.take("b"), table.take("c")] == [0, 1, 2]
    with pytest.raises(InvariantError, match="no free row"):
        table.take("d")
    table.release(1)
    table.release(1)  # twice: still one free row
    assert table.free() == [1] and table.highest() == 2 and len(table) == 2
    assert table.take("e") == 1 and table.holder(1) == "e"
    table.clear()
    assert not table and table.free() == [0, 1, 2] and table.highest() == 0


@pytest.mark.parametrize("needed", [1, 17, 64, 65, 200, 8257])
def test_row_slots_hold_the_prompt_and_a_round_past_the_longest_request(needed):
    slots = row_slots(16, needed, 17)
    assert slots == max(16, needed + 17)  # no slot the table's reads would cover for nothing
    paged = row_slots(16, needed, 17, unit=64)
    assert paged % 64 == 0 and max(16, needed + 17) <= paged < max(16, needed + 17) + 64
    assert row_slots(512, 8, 1) >= 512
