"""Optimized HLO text, parsed into computations and
instructions: what ``jaxdd.planning.compiled_traffic`` walks.

The text is what ``compiled.as_text()`` (or ``HloModule.to_string()``) prints
for XLA:CPU, XLA:GPU and XLA:TPU alike; only the parts the traffic account
reads are kept: each instruction's shape, opcode, operands and the attributes
that name called computations, trip counts, metadata and backend config.
"""

from __future__ import annotations

import dataclasses
import math
import re

# Bits per element of HLO's primitive types (sub-byte types are stored packed); the small
# floats name their bits first and their exponent and mantissa after (f8e4m3fn, f4e2m1fn).
_BITS = {"pred": 8, "token": 0, "c64": 64, "c128": 128, "bf16": 16}
_SIZED = re.compile(r"[suf](\d+)(e\d+m\d+\w*)?")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,<=]*)\](\{[^{}]*\})?")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \((.*)\) -> .*\{$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = (.*)$")
_NAME = re.compile(r"%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str  # e.g. "bf16[8,1024]{1,0}" or a tuple "(f32[], s32[4]{0})"
    opcode: str
    operands: list[str]  # instruction names
    attributes: str  # everything after the operand list
    operand_text: str  # the operand list as written (constants' literals are here)

    def attribute(self, key: str) -> str | None:
        """An attribute's value: ``calls=%f`` gives "f"; ``custom_call_target="x"`` gives "x"."""
        found = re.search(rf"\b{key}=(%[\w.\-]+|\"[^\"]*\"|\{{[^}}]*\}}|[^,\s]+)", self.attributes)
        return None if found is None else found.group(1).strip('%"')

    def called(self, key: str) -> list[str]:
        """Computations named by ``key`` (``calls``, ``body``, ``branch_computations``, ...)."""
        found = re.search(rf"\b{key}=(\{{[^}}]*\}}|%[\w.\-]+)", self.attributes)
        return [] if found is None else _NAME.findall(found.group(1))

    @property
    def op_name(self) -> str:
        found = _OP_NAME.search(self.attributes)
        return "" if found is None else found.group(1)

    @property
    def backend_config(self) -> str:
        start = self.attributes.find("backend_config=")
        return "" if start < 0 else self.attributes[start:]


@dataclasses.dataclass
class Computation:
    name: str
    instructions: dict[str, Instruction]  # in program order
    root: str
    parameters: dict[int, str]  # parameter number -> instruction name

    def users(self, name: str) -> list[tuple[Instruction, int]]:
        """The instructions that take ``name`` as an operand, with the operand's position."""
        return [
            (i, k)
            for i in self.instructions.values()
            for k, o in enumerate(i.operands)
            if o == name
        ]


def parse_module(text: str) -> tuple[dict[str, Computation], str]:
    """The module's computations by name, and the entry computation's name."""
    computations: dict[str, Computation] = {}
    entry = ""
    current: Computation | None = None
    for line in text.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header:
                current = Computation(header.group(2), {}, "", {})
                entry = header.group(2) if header.group(1) else entry
            continue
        if line.strip() == "}":
            computations[current.name] = current
            current = None
            continue
        found = _INSTRUCTION.match(line)
        if found:
            instruction = _instruction(found.group(2), found.group(3))
            current.instructions[instruction.name] = instruction
            if found.group(1):
                current.root = instruction.name
            if instruction.opcode == "parameter":
                current.parameters[int(instruction.operand_text)] = instruction.name
    return computations, entry


def _instruction(name: str, text: str) -> Instruction:
    shape, rest = _split_shape(text)
    opcode, _, rest = rest.partition("(")
    operand_text, rest = _balanced(rest)
    return Instruction(
        name, shape, opcode.strip(), _NAME.findall(operand_text), rest, operand_text.strip()
    )


def _split_shape(text: str) -> tuple[str, str]:
    if text.startswith("("):
        inner, rest = _balanced(text[1:])
        return f"({inner})", rest.lstrip()
    shape, _, rest = text.partition(" ")
    return shape, rest


def _balanced(text: str) -> tuple[str, str]:
    """Split ``text`` (just after an opening parenthesis) at its matching closing one."""
    depth = 1
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return text[:i], text[i + 1 :]
    return text, ""


def element_bits(dtype: str) -> int | None:
    """Bits per element of an HLO element type (None: not an array type)."""
    sized = _SIZED.fullmatch(dtype)
    return int(sized.group(1)) if sized else _BITS.get(dtype)


def array_shapes(shape: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(element type, dimensions, layout) of each array in a shape, tuples flattened in order."""
    arrays = []
    for dtype, dims, layout in _ARRAY.findall(shape):
        if element_bits(dtype) is not None:
            sizes = tuple(int(d.replace("<=", "")) for d in dims.split(",") if d)
            arrays.append((dtype, sizes, layout))
    return arrays


def in_device_memory(layout: str) -> bool:
    """Whether an array's layout places it in device memory (HBM): TPU layouts
    name other memory spaces (``S(1)``: VMEM, on chip) after a colon."""
    found = re.search(r"S\((\d+)\)", layout.partition(":")[2])
    return found is None or found.group(1) == "0"


def shape_bytes(
    shape: str, element: int | None = None, anywhere: bool = False, padded: bool = True
) -> int:
    """Bytes in device memory (``anywhere``: in any memory) of a shape or of its ``element``-th
    array, as laid out: tiled dimensions padded to whole tiles (unless not ``padded``), packed
    sub-byte types rounded up."""
    arrays = array_shapes(shape)
    if element is not None:
        arrays = arrays[element : element + 1]
    total = 0
    for dtype, dims, layout in arrays:
        if anywhere or in_device_memory(layout):
            total += math.ceil(
                math.prod(tiled(dims, layout) if padded else dims) * element_bits(dtype) / 8
            )
    return total


def tiled(dims: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """``dims`` padded to the layout's tile (TPU: ``2,1,0:T(8,128)(2,1)``, its first tile over
    the minor-most dimensions; a bf16[P, 64, 64] pool takes 128 lanes a row)."""
    order, _, tiles = layout.strip("{}").partition(":")
    tile = re.match(r"T\(([\d,]+)\)", tiles)
    if tile is None or not order:
        return dims
    padded = list(dims)
    minor_first = [int(d) for d in order.split(",")]
    for dim, size in zip(minor_first, reversed(tile.group(1).split(",")), strict=False):
        padded[dim] = -(-padded[dim] // int(size)) * int(size)
    return tuple(padded)
