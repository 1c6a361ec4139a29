"""The latent cache striped over 8 simulated CPU devices (decode context parallelism): pages
dealt as ``jaxdd.cache.stripes`` says, rows written and read where they live, and the tokens of
one device for every round kind, both attention forms and sampled rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxdd
from jaxdd.cache.layout import CacheView, write_rows
from jaxdd.cache.pages import PageTable
from jaxdd.cache.paging import Paging, pool_pages
from jaxdd.cache.stripes import PAGES, Stripes
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.decoding.requests import RowRequest
from jaxdd.decoding.rows import RowPool
from jaxdd.decoding.sampling import Sampling
from jaxdd.errors import InputError
from jaxdd.runtime.compile_time import compile_clock
from jaxdd.runtime.sharding import make_mesh
from jaxdd.testing.pools import run_alone
from jaxdd.testing.profiles import examples
from jaxdd.testing.reference import SHARDABLE_DRAFTER, SHARDABLE_K2, save_random_pair

PROMPT = [(7 * i + 3) % 250 for i in range(41)]
# short pages, so that a short context spans every device (the runtime's pages hold 64 tokens)
PAGE = 4


def table(rows: int, tokens: list[int], page: int, devices: int, row_pages: int):
    """Page tables of ``rows`` rows of ``row_pages`` pages, row i holding ``tokens[i]`` slots,
    as the runtime deals them, and the pool's pages."""
    pool = pool_pages(rows * row_pages * page, page, devices)
    pages = PageTable(rows, Paging(row_pages, pool, page, devices))
    for row, n in enumerate(tokens):
        pages.take(row, n)
    return pages.table, pool


@given(
    devices=st.sampled_from([1, 2, 4, 8]),
    page=st.sampled_from([1, 4, 64]),
    length=st.integers(0, 2000),
)
@settings(max_examples=examples(40), deadline=None)
def test_each_device_holds_its_pages_in_order(devices, page, length):
    stripes = Stripes(make_mesh(devices), page)
    row_pages = -(-(length + 1) // (page * devices)) * devices
    pages, pool = table(1, [length + 1], page, devices, row_pages)
    share = pool // devices
    view = CacheView(jnp.asarray([length], jnp.int32), jnp.asarray(pages))
    positions = np.arange(row_pages * page)
    owner = (positions // page) % devices
    for device in range(devices):
        local = stripes.local_view(view, device, share)
        own = np.asarray(local.pages)[0]
        np.testing.assert_array_equal(own, pages[0, device::devices] - device * share)
        assert ((own >= 0) & (own < share)).all()
        committed = int(local.length[0])
        assert committed == ((owner == device) & (positions < length)).sum()


@pytest.fixture(scope="module")
def stripes() -> Stripes:
    return Stripes(make_mesh(8), PAGE)


def test_rows_are_written_and_read_where_they_live(stripes):
    rng = np.random.default_rng(5)
    row_pages, width = 6 * 8, 3
    pages, pool_size = table(2, [170, 120], PAGE, 8, row_pages)
    pool = jax.device_put(
        jnp.asarray(rng.normal(size=(pool_size, PAGE, width)), jnp.float32),
        jax.sharding.NamedSharding(stripes.mesh, PAGES),
    )
    by_position = np.asarray(pool)[pages].reshape(2, -1, width)  # each row's slots, in order
    start = jnp.array([13, 99], jnp.int32)
    rows = jnp.asarray(rng.normal(size=(2, 21, width)), jnp.float32)
    written = stripes.write(pool, jnp.asarray(pages), rows, start)
    expected = np.asarray(write_rows(jnp.asarray(by_position), rows, start))
    slots = row_pages * PAGE
    back = stripes.read(
        written, jnp.asarray(pages), jnp.broadcast_to(jnp.arange(slots), (2, slots))
    )
    taken = (pages != Paging(row_pages, pool_size, PAGE, 8).null_table(2))[:, :, None]
    held = np.repeat(taken, PAGE, axis=2).reshape(2, -1)  # a null page's rows are anyone's
    np.testing.assert_array_equal(np.asarray(back)[held], expected[held])
    # each page is where the table says, on the device that owns it
    np.testing.assert_array_equal(
        np.asarray(written)[pages].reshape(2, -1, width)[held], expected[held]
    )
    share = pool_size // 8
    assert all((pages[:, j] // share == j % 8).all() for j in range(row_pages))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("stripes")
    save_random_pair(root, SHARDABLE_K2, SHARDABLE_DRAFTER, seed=11)
    return root


def decoder(checkpoints, devices: int, **options) -> SpeculativeDecoder:
    pair = jaxdd.load_pair(checkpoints / "target", checkpoints / "drafter", "float32", devices)
    return SpeculativeDecoder(*pair, **options)


ROUNDS = {
    "ar": {"method": "ar"},
    "dflash": {"method": "dflash"},
    "ddtree": {"method": "ddtree", "budget": 12},
    "sampled ddtree": {"method": "ddtree", "budget": 12, "sampling": Sampling(0.9, seed=4)},
    "sampled dflash": {"method": "dflash", "sampling": Sampling(0.7, top_k=20, seed=9)},
}


def generate(dec: SpeculativeDecoder, names, prompt=PROMPT) -> dict:
    results = {}
    for name in names:
        out = dec.generate(prompt, max_new_tokens=30, stop_token_ids=[], **ROUNDS[name])
        results[name] = (out.tokens, out.acceptance_lengths)
    return results


@pytest.fixture(scope="module")
def alone(checkpoints) -> SpeculativeDecoder:
    return decoder(checkpoints, 1)


@pytest.fixture(scope="module")
def one_device(alone):
    return generate(alone, ROUNDS)


@pytest.fixture(scope="module")
def striped(checkpoints) -> SpeculativeDecoder:
    """The latent cache striped in pages of PAGE tokens: a short prompt spans every device's."""
    dec = decoder(checkpoints, 8, cache_layout="striped")
    dec.stripes = Stripes(dec.mesh, PAGE)
    return dec


@pytest.fixture(scope="module")
def striped_in_runtime_pages(checkpoints) -> SpeculativeDecoder:
    """The latent cache striped in the runtime's pages (64 tokens): a short prompt on one device."""
    return decoder(checkpoints, 8, cache_layout="striped")


# The pool tests' one shape (their compiled rounds and whole prefills shared): prompts to 80
# tokens, so that a second turn of PROMPT's conversation fits.
POOL = {"method": "ddtree", "budget": 12, "rows": 2, "max_len": 112, "max_prompt": 80}


@pytest.mark.slow
@pytest.mark.parametrize("page", [PAGE, None])
def test_striped_gives_the_tokens_of_one_device(request, one_device, page):
    dec = request.getfixturevalue("striped" if page is not None else "striped_in_runtime_pages")
    assert generate(dec, ROUNDS) == one_device
    with compile_clock() as compiles:
        generate(dec, ["ddtree"], PROMPT[::-1])  # the same shapes: nothing new to compile
    assert compiles.count == 0


def test_striped_cache_is_split_along_its_pages(striped_in_runtime_pages):
    dec = striped_in_runtime_pages
    state = dec.admitted([PROMPT], max_new_tokens=8).state
    latent = state.target_cache.latent[0]
    assert latent.sharding.spec == PAGES
    assert latent.addressable_shards[0].data.shape[0] == latent.shape[0] // 8
    assert state.target_cache.stripes == dec.stripes


@pytest.mark.slow
def test_the_kernel_form_merges_the_same(checkpoints, one_device):
    dec = decoder(checkpoints, 8, cache_layout="striped", attention="pallas")
    dec.stripes = Stripes(dec.mesh, PAGE)
    names = ["ddtree", "sampled dflash"]
    assert generate(dec, names) == {name: one_device[name] for name in names}


@pytest.mark.slow
def test_the_kernel_form_over_fp8_drafter_kv_gives_the_same_tokens(checkpoints, one_device):
    """The drafter's K/V in fp8, attended in the kernel per device on its KV heads, the latent
    cache striped: the target's tokens (the drafts may change, the tokens may not)."""
    dec = decoder(checkpoints, 8, cache_layout="striped", attention="pallas", drafter_kv="fp8")
    dec.stripes = Stripes(dec.mesh, PAGE)
    state = dec.admitted([PROMPT], max_new_tokens=8).state
    assert state.draft_cache.keys[0].dtype == jnp.float8_e4m3fn
    names = ["dflash", "ddtree"]  # greedy: sampled tokens follow the drafts they were offered
    tokens = {name: result[0] for name, result in generate(dec, names).items()}
    assert tokens == {name: one_device[name][0] for name in names}


def test_an_unknown_layout_names_the_field(checkpoints):
    with pytest.raises(InputError, match="cache_layout"):
        decoder(checkpoints, 1, cache_layout="sharded")


@pytest.mark.slow
def test_a_striped_pool_serves_rows_admitted_between_rounds(striped, alone):
    """The server's pool on the striped cache: requests admitted while others decode (rows at
    other lengths, so other devices' pages) give one device's tokens, and nothing compiles."""
    pool = RowPool.serving(striped, **POOL)
    pool.warm_up()
    requests = [
        RowRequest(PROMPT, 20, [], Sampling()),
        RowRequest(PROMPT[5:30], 25, [], Sampling(0.8, seed=2)),
        RowRequest(PROMPT[::2], 15, [], Sampling()),
    ]
    outputs, owner = {}, {}
    with compile_clock() as compiles:
        for round_ in range(200):  # bounded: every request ends within its max_tokens rounds
            if requests and pool.free_rows() and round_ % 3 == 0:
                owner[pool.admit([pool.check(requests[0])])[0]] = len(outputs)
                outputs[len(outputs)] = (requests.pop(0), [])
            elif not requests and not pool.busy:
                break
            for row, update in pool.step().items():
                outputs[owner[row]][1].extend(update.tokens)
    assert compiles.count == 0 and not requests
    for request, tokens in outputs.values():
        options = {"max_new_tokens": request.max_new_tokens, "sampling": request.sampling}
        expected = alone.generate(
            request.prompt, method="ddtree", budget=12, stop_token_ids=[], **options
        )
        assert tokens == expected.tokens


@pytest.mark.slow
def test_a_striped_prefix_cache_hit_gives_one_devices_tokens(striped, alone):
    """A conversation's second turn on the striped cache finds the first turn's pages, dealt over
    every device (pages of 4 tokens), prefills only the rest and decodes to one device's tokens
    for its full prompt; nothing compiles after warm-up."""
    pool = RowPool.serving(striped, prefix_cache=True, **POOL)
    pool.warm_up()
    first = RowRequest(PROMPT, 20, [], Sampling())
    sampling = Sampling(0.8, seed=3)
    with compile_clock() as compiles:
        said, _, none = run_alone(pool, first)
        history = PROMPT + said + [5, 9, 2, 7]  # resent with a new message
        answer, _, found = run_alone(pool, RowRequest(history, 16, [], sampling))
    assert compiles.count == 0 and len(said) == 20
    # the first turn's prompt and answer (less the newest token and the drafter's lag of a
    # round), in whole pages of 4
    assert none == 0 and found == (len(PROMPT) + 19 - pool.shape.spec.width) // PAGE * PAGE
    expected = alone.generate(
        history, method="ddtree", budget=12, max_new_tokens=16, stop_token_ids=[], sampling=sampling
    )
    assert answer == expected.tokens
