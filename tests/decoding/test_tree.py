"""DDTree builder: the device build against the paper's
heap (host oracle), invariants, ties, and the accept walk.

Stated tolerance: the oracle sums float64 scores incrementally (logw - lp[r] + lp[r+1]), the
device keeps fp32 running sums, so the two may order two nodes differently only when their
scores lie within float rounding of each other. ``SCORE_TOL`` (1e-4 in log-prob units, for
paths of up to 8 terms of magnitude <= ~20) is the gap above which the order must agree
exactly; exact ties (equal log-probs) are checked separately and must agree exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from jaxdd.decoding.tree import accept_path, build_tree, build_tree_host
from jaxdd.testing.profiles import examples

SCORE_TOL = 1e-4


build = jax.jit(build_tree, static_argnames=("budget", "max_children"))

# Each (depth, vocab, budget) is one compilation, so
# the property tests draw shapes from short lists.
SHAPES = [
    (1, 2, 1),
    (2, 3, 31),
    (3, 7, 5),
    (4, 40, 16),
    (5, 1000, 31),
    (8, 40, 64),
    (6, 1000, 256),
    (8, 2, 256),
]
TIE_SHAPES = [(1, 4, 3), (3, 10, 8), (6, 64, 100), (4, 4, 30)]


def device_tree(
    logits: np.ndarray, budget: int, depth_limit: int | None = None, max_children: int | None = None
):
    tree = build(
        jnp.asarray(logits)[None],
        jnp.array([-1]),
        jnp.array([logits.shape[0] if depth_limit is None else depth_limit]),
        budget=budget,
        max_children=max_children,
    )
    return {
        name: np.asarray(getattr(tree, name))[0]
        for name in ("tokens", "parents", "depths", "valid", "visible")
    }


def check_invariants(tree: dict, logits: np.ndarray) -> None:
    n = int(tree["valid"].sum()) - 1
    # valid nodes come first
    assert tree["valid"][: n + 1].all() and not tree["valid"][n + 1 :].any()
    children_of: dict[int, list[int]] = {}
    for i in range(1, n + 1):
        parent = tree["parents"][i]
        assert 0 <= parent < i  # parent before child
        assert tree["depths"][i] == tree["depths"][parent] + 1
        children_of.setdefault(parent, []).append(tree["tokens"][i])
        expected = np.zeros(len(tree["valid"]), bool)
        expected[i] = True
        expected |= tree["visible"][parent]
        np.testing.assert_array_equal(tree["visible"][i], expected)
    for siblings in children_of.values():
        assert len(set(siblings)) == len(siblings)  # sibling tokens distinct
    assert tree["depths"].max() <= logits.shape[0]


def compare_with_oracle(tree: dict, host) -> None:
    n = len(host.tokens)
    assert tree["valid"].sum() - 1 == n
    np.testing.assert_array_equal(tree["tokens"][1 : n + 1], host.tokens)
    np.testing.assert_array_equal(tree["parents"][1 : n + 1], host.parents[1:])
    np.testing.assert_array_equal(tree["depths"][1 : n + 1], host.depths)


@pytest.mark.slow
@settings(
    max_examples=examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(
    shape=st.sampled_from(SHAPES),
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([0.5, 3.0, 10.0]),
)
def test_matches_heap_oracle(shape, seed, scale):
    depth, vocab, budget = shape
    logits = (np.random.default_rng(seed).standard_normal((depth, vocab)) * scale).astype(
        np.float32
    )
    tree = device_tree(logits, budget)
    check_invariants(tree, logits)
    host = build_tree_host(logits, budget + 1)  # one extra pop: the first node left out
    popped = np.sort(host.scores)[::-1]
    # no two competing scores within tolerance
    assume(len(popped) < 2 or np.diff(popped).max() < -SCORE_TOL)
    compare_with_oracle(tree, build_tree_host(logits, budget))


@pytest.mark.slow
@settings(
    max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.filter_too_much]
)
@given(shape=st.sampled_from(TIE_SHAPES), seed=st.integers(0, 2**31 - 1))
def test_exact_ties_break_by_rank_tuple(shape, seed):
    """Logits in equal pairs, and flat rows: many exact
    ties, which both sides break by the rank tuple.

    Rows are scaled apart so that two depths never share log-probs: sums of
    the same values in another order tie exactly in the oracle's float64
    but may differ by an ulp in fp32, a near-tie rather than a tie.
    """
    depth, vocab, budget = shape
    rng = np.random.default_rng(seed)
    scale = (1 + 0.137 * np.arange(depth))[:, None]
    half = (rng.integers(-3, 3, (depth, vocab // 2)) * scale).astype(np.float32)
    logits = np.concatenate([half, half], axis=1)
    logits[rng.random(depth) < 0.3] = 0.0  # some rows uniform
    tree = device_tree(logits, budget)
    check_invariants(tree, logits)
    host = build_tree_host(logits, budget + 1)
    gaps = -np.diff(np.sort(host.scores)[::-1])
    assume(((gaps == 0) | (gaps > SCORE_TOL)).all())  # exact ties, or clearly apart
    compare_with_oracle(tree, build_tree_host(logits, budget))


def test_fewer_nodes_than_budget():
    logits = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    tree = device_tree(logits, 20)  # only 3 + 9 nodes exist
    assert tree["valid"].sum() == 13
    check_invariants(tree, logits)
    compare_with_oracle(tree, build_tree_host(logits, 20))


def test_chain_and_depth_limit():
    logits = np.random.default_rng(1).standard_normal((7, 50)).astype(np.float32)
    chain = device_tree(logits, 7, max_children=1)
    np.testing.assert_array_equal(chain["tokens"][1:], logits.argmax(-1))
    np.testing.assert_array_equal(chain["parents"][1:], np.arange(7))
    shallow = device_tree(logits, 16, depth_limit=3)
    assert shallow["depths"].max() <= 3
    compare_with_oracle(shallow, build_tree_host(logits[:3], 16))


def follow_verified_tree(tokens, parents, valid, posterior):
    """The paper's host walk (liranringel/ddtree follow_verified_tree)."""
    children = {}
    for i in range(1, len(tokens)):
        if valid[i]:
            children.setdefault(int(parents[i]), {})[int(tokens[i])] = i
    path, current = [0], 0
    while int(posterior[current]) in children.get(current, {}):
        current = children[current][int(posterior[current])]
        path.append(current)
    return path


def test_accept_path_matches_the_host_walk():
    rng = np.random.default_rng(2)
    for trial in range(30):
        depth, budget = 5, 24
        logits = rng.standard_normal((depth, 6)).astype(np.float32)
        tree = build(jnp.asarray(logits)[None], jnp.array([9]), jnp.array([depth]), budget=budget)
        tokens = np.asarray(tree.tokens[0])
        # Posterior: follow a random root-to-node path, then random tokens.
        posterior = rng.integers(0, 6, budget + 1)
        node = int(rng.integers(0, budget + 1))
        while node != 0:
            parent = int(tree.parents[0, node])
            posterior[parent] = tokens[node]
            node = parent
        path, accepted = accept_path(tree, jnp.asarray(posterior)[None], depth)
        expected = follow_verified_tree(
            tokens, np.asarray(tree.parents[0]), np.asarray(tree.valid[0]), posterior
        )
        assert int(accepted[0]) == len(expected) - 1, trial
        np.testing.assert_array_equal(np.asarray(path[0, : len(expected)]), expected)
