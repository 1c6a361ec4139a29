"""Placing a target and drafter on a mesh of 1..8 devices:
one rules table from logical axes to the mesh axis.

Every parameter carries logical axis names (``jaxdd.models.layers.param``);
``RULES`` maps them to the single mesh axis ``"model"``. Two MoE modes:

- ``tp``: tensor-parallel everything: attention heads,
  dense-MLP width and each routed expert's FFN width are split.
- ``ep``: expert-parallel routed experts: each device holds ``E /
  devices`` whole experts; attention and dense MLPs stay tensor-parallel.

XLA's partitioner inserts the collectives for the tensor-parallel parts. The routed
experts run in ``shard_map`` in both modes: every device sees all (token, route) pairs (a
decode step has a few hundred at most), computes its share (its slice of every expert, or
its own experts) and the shares are summed across devices; no ``ragged_all_to_all``,
which XLA:CPU lacks. The Pallas tree-attention kernel also runs per device on its heads.

Embedding and lm_head are vocab-parallel in both modes; XLA's partitioner keeps the global argmax,
top-k and logsumexp of the tree build exact. The MLA latent cache holds one row per token shared
by all heads, so it is replicated; the drafter's KV cache is split by KV heads. A dimension that
the mesh does not divide is replicated instead (e.g. a 4-head drafter on 8 devices).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxdd.types import MOE_MODES, MoeMode

# where a model's parameters go, and how its routed experts are split
Placement = tuple[Mesh, MoeMode]
AXIS = "model"

RULES: dict[MoeMode, dict[str, str | None]] = {
    mode: {
        "vocab": AXIS,
        "heads": AXIS,
        "kv_heads": AXIS,
        "mlp": AXIS,
        "expert_mlp": AXIS if mode == "tp" else None,
        "experts": AXIS if mode == "ep" else None,
        "embed": None,
        "q_lora": None,
    }
    for mode in MOE_MODES
}


def make_mesh(devices: int | None = None, available: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh over the first ``devices`` of ``available`` (default:
    all of this process's JAX devices; a deviceless topology's for
    ``jaxdd.plan``). Auto axes: XLA propagates the shardings."""
    available = list(jax.devices() if available is None else available)
    devices = len(available) if devices is None else devices
    if not 1 <= devices <= len(available):
        raise ValueError(f"devices: expected 1..{len(available)}, got {devices}")
    return Mesh(np.array(available[:devices]), (AXIS,), axis_types=(AxisType.Auto,))


def partition_spec(
    shape: tuple[int, ...],
    axes: tuple[str | None, ...],
    mesh: Mesh,
    mode: MoeMode,
    units: tuple[int, ...] | None = None,
) -> PartitionSpec:
    """The spec of one array: its logical axes through ``RULES``; a
    dimension stays whole when the mesh does not split it into multiples of
    its unit (quantization groups and blocks must not straddle devices)."""
    size = mesh.shape[AXIS]
    units = units or (1,) * len(shape)
    spec = []
    used = False
    for dim, name, unit in zip(shape, axes, units, strict=True):
        mapped = RULES[mode].get(name) if name is not None else None
        if mapped is not None and dim % (size * unit) == 0 and not used:
            spec.append(mapped)
            used = True  # one mesh axis splits at most one dimension of an array
        else:
            spec.append(None)
    return PartitionSpec(*spec)


class Placeable:
    """A module that runs collectives by hand once placed (its
    ``placement``), and may split some of its parameters together rather
    than one by one through ``RULES``. The owner knows its own layout."""

    placement: Placement | None = None

    def joint_specs(self, mesh: Mesh, mode: MoeMode) -> dict[tuple[str, ...], PartitionSpec]:
        """Specs of the parameters split together, by path
        below this module; the others follow ``RULES``."""
        return {}

    def accepts(self, mesh: Mesh, mode: MoeMode) -> bool:
        """Whether the module runs its collectives on
        ``mesh`` (else it keeps its single-device path)."""
        return True


def param_shardings(module: nnx.Module, mesh: Mesh, mode: MoeMode) -> nnx.State:
    """A NamedSharding for every parameter of ``module`` (from its ``logical_axes`` metadata)."""
    pieces = {}
    for path, sub in nnx.iter_modules(module):
        if isinstance(sub, Placeable):
            pieces |= {(*path, *below): spec for below, spec in sub.joint_specs(mesh, mode).items()}

    def sharding(path, variable):
        key = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
        spec = pieces.get(key)
        if spec is None:
            axes = (
                variable.get_metadata().get("logical_axes") or (None,) * variable.get_value().ndim
            )
            spec = partition_spec(variable.get_value().shape, axes, mesh, mode)
        return NamedSharding(mesh, spec)

    state = nnx.state(module, nnx.Param)
    return jax.tree_util.tree_map_with_path(
        sharding, state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )


def abstract_shardings(
    graphdef: nnx.GraphDef, abstract: nnx.State, mesh: Mesh, mode: MoeMode
) -> dict:
    """``param_shardings`` of a model not loaded yet (its
    abstract state), as a pure dict like the state's."""
    shardings = param_shardings(nnx.merge(graphdef, abstract), mesh, mode)
    return nnx.to_pure_dict(shardings)


def shard_module(module: nnx.Module, mesh: Mesh, mode: MoeMode) -> nnx.Module:
    """Move ``module``'s parameters into their shardings
    (in place) and tell its MoE layers where they run."""
    shardings = param_shardings(module, mesh, mode)
    place(module, mesh, mode)
    state = nnx.state(module, nnx.Param)
    is_variable = lambda x: isinstance(x, nnx.Variable)
    placed = jax.tree.map(lambda v, s: _put(v[...], s), state, shardings, is_leaf=is_variable)
    nnx.update(module, placed)
    return module


def _put(value: jax.Array | np.ndarray, sharding: NamedSharding) -> jax.Array:
    """``value`` in ``sharding``; on a mesh spanning several processes
    (which all hold the whole value), each process places only its own
    devices' shards (device_put takes this process's devices only)."""
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place(module: nnx.Module, mesh: Mesh, mode: MoeMode) -> None:
    """Tell the modules that run collectives by hand (the vocab-parallel
    embedding lookup, the MoE layers' ``shard_map`` dispatch) where they
    run; an MoE whose experts stay replicated keeps its plain dispatch."""
    if mode not in RULES:
        raise ValueError(f"MoE mode: expected 'tp' or 'ep', got {mode!r}")
    for _, sub in nnx.iter_modules(module):
        if isinstance(sub, Placeable) and sub.accepts(mesh, mode):
            sub.placement = (mesh, mode)


def mesh_of(module: nnx.Module) -> Mesh | None:
    """The mesh a module was placed on by ``shard_module`` (None for a single-device module)."""
    for leaf in jax.tree.leaves(nnx.state(module, nnx.Param)):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
            return sharding.mesh
    return None


def cache_sharding(
    shape: tuple[int, ...], axes: tuple[str | None, ...], mesh: Mesh
) -> NamedSharding:
    """Caches: the MLA latent rows are shared by all
    heads (replicated); drafter K/V split by KV heads."""
    return NamedSharding(mesh, partition_spec(shape, axes, mesh, "tp"))
