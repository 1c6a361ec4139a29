"""The jitted programs a decode state passes through, naming its formats where the platform's
default layout is not the one its kernels read.

XLA:TPU lays a pool of pages narrower than 128 lanes (the rope pool, bf16[P, 64, 64]) out
pages-minor, sparing the lanes' padding, while the Mosaic tree-attention kernel reads a page in
row-major tiles: unnamed, the pool is copied around every call (v5p, 128k: the AR round at 1.23x
its floor). A jit keeps an argument's layout only where its ``in_shardings`` name it, so every
program that takes or returns the state names the same formats (``StatePrograms``); elsewhere
the defaults are the kernels' layouts and the plain jits run."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.experimental.layout import Format, Layout

from jaxdd.decoding.prefill import prefill_after, prefill_new, prefill_row
from jaxdd.decoding.rounds import decode_round, front_round
from jaxdd.decoding.state import DecodeState, state_shardings


class StatePrograms(NamedTuple):
    """The jits that take (and donate) or make a decode state, as ``jaxdd.decoding.rounds`` and
    ``jaxdd.decoding.prefill`` define them."""

    decode_round: Callable
    front_round: Callable
    prefill_row: Callable
    prefill_after: Callable
    prefill_new: Callable


PLAIN = StatePrograms(decode_round, front_round, prefill_row, prefill_after, prefill_new)
# each program's static arguments, as its decorator names them
STATIC = StatePrograms(
    ("spec",),
    ("spec", "rows"),
    ("spec", "mesh", "score"),
    ("spec", "mesh"),
    ("spec", "paging", "mesh", "score"),
)


def names_formats(mesh: jax.sharding.Mesh | None) -> bool:
    """Whether a state on ``mesh`` (None: the default device) needs its formats named: on TPU."""
    return _device(mesh).platform == "tpu"


def state_formats(state: DecodeState, mesh: jax.sharding.Mesh | None) -> DecodeState:
    """Where ``state`` (abstract) lives on ``mesh`` (None: the default device) with its pools of
    pages row-major, the layout of the kernels' blocks."""
    if mesh is None:
        one = jax.sharding.SingleDeviceSharding(_device(mesh))
        shardings = jax.tree.map(lambda _: one, state)
    else:
        shardings = state_shardings(state, mesh)

    def row_major(placed, arrays):
        kind = type(arrays)  # a tuple per layer, or a Pool
        return kind(
            Format(Layout(tuple(range(x.ndim))), s) for s, x in zip(placed, arrays, strict=True)
        )

    target = shardings.target_cache
    pools = {
        name: row_major(getattr(target, name), getattr(state.target_cache, name))
        for name in ("latent", "rope")
    }
    formats = shardings.replace(target_cache=target.replace(**pools))
    if state.draft_cache is None:
        return formats
    draft = shardings.draft_cache
    pools = {
        name: row_major(getattr(draft, name), getattr(state.draft_cache, name))
        for name in ("keys", "values")
    }
    return formats.replace(draft_cache=draft.replace(**pools))


def _device(mesh: jax.sharding.Mesh | None) -> Any:
    return jax.devices()[0] if mesh is None else mesh.devices.flat[0]


def programs_for(state: DecodeState, mesh: jax.sharding.Mesh | None) -> StatePrograms:
    """The programs for ``state`` (arrays or ShapeDtypeStructs) on ``mesh``."""
    return state_programs(state_formats(state, mesh) if names_formats(mesh) else None)


def state_programs(formats: DecodeState | None) -> StatePrograms:
    """The programs for a state of ``formats`` (``state_formats``): the plain jits where it is
    None, else each wrapped in a jit naming them where it takes and returns the state."""
    if formats is None:
        return PLAIN
    leaves, tree = jax.tree.flatten(formats)
    return _named(tree, tuple(leaves))


@functools.cache
def _named(tree: Any, leaves: tuple) -> StatePrograms:
    """``state_programs`` once per formats (hashable as their tree and leaves)."""
    formats = jax.tree.unflatten(tree, leaves)
    return StatePrograms(*map(functools.partial(_naming, formats), PLAIN, STATIC))


def _naming(formats: DecodeState, program: Callable, statics: tuple[str, ...]) -> Callable:
    """``program`` (a jit) in a jit that names ``formats`` for its ``state`` argument, if it has
    one, and for the state it returns first, with the same static and donated arguments."""
    dynamic = [name for name in inspect.signature(program).parameters if name not in statics]
    ins = tuple(formats if name == "state" else None for name in dynamic)
    return jax.jit(
        program,
        static_argnames=statics,
        donate_argnames=("state",) if "state" in dynamic else (),
        in_shardings=ins,
        out_shardings=(formats, None),
    )
