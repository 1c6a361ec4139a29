"""Jit helper: pass NNX modules to jitted functions as a flat list of arrays.

Flattening an NNX State to build jit's cache key costs host time on the order of a small model's
decode step (benchmarks/README.md). So modules are split once, the static structure (graphdef +
treedef) goes in as a hashable static argument and the arrays as a list, merged inside the jit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx


@dataclasses.dataclass(frozen=True, eq=False)
class ModuleStructure:
    """The static half of a split module: hashable, so it can be a static jit argument.

    jit hashes its static arguments on every call, and an NNX GraphDef's hash walks the whole module
    graph. So the hash is computed once, and a structure compares equal to itself without a walk.
    """

    graphdef: Any
    treedef: Any
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.graphdef, self.treedef)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, ModuleStructure) or self._hash != other._hash:
            return False
        return (self.graphdef, self.treedef) == (other.graphdef, other.treedef)

    def merge(self, leaves: list[jax.Array]) -> nnx.Module:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))


# One object per module structure. jit compares a call's static arguments with its cache
# keys, and two equal structures that are different objects are compared graph by graph,
# on every round, by a decoder that was built after another one compiled the same shapes
# (``Target.generate`` builds one per call). The compiled functions keep their structures
# alive anyway, so holding them here costs nothing extra.
_STRUCTURES: dict[ModuleStructure, ModuleStructure] = {}


def split_module(module: nnx.Module) -> tuple[ModuleStructure, list[jax.Array]]:
    graphdef, state = nnx.split(module)
    leaves, treedef = jax.tree.flatten(state)
    structure = ModuleStructure(graphdef, treedef)
    return _STRUCTURES.setdefault(structure, structure), leaves
