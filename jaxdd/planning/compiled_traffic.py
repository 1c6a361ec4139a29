"""What a compiled program moves: the bytes per device that its optimized HLO reads from and writes
to device memory, by stage of the round, by weight and by instruction (``jaxdd.compiled_traffic``).

XLA's own cost analysis cannot say: a deviceless GPU compile returns none,
and XLA:TPU's counts a gather of 8 of 384 experts as the whole table and a
loop as one trip. This walks the HLO instead, with the rules decode needs:

- an instruction reads its operands and writes its output, once per run of its computation;
- a gather, slice or dynamic slice reads what it outputs, inside a fusion too (a
  fusion reads of each operand what its fused computation touches); a
  dynamic-update-slice or scatter updates in place: it reads and writes the update
  (a buffer that is not donated shows up as the copy XLA inserts before it);
- a while loop runs its body its trip count (``known_trip_count`` in its backend
  config, else the induction variable its condition compares with a constant); a
  conditional counts its larger branch, and the account says which;
- a collective moves what it sends plus what it receives (ring algorithms over
  its replica group of n devices: an all-reduce of N bytes sends and receives
  2 (n - 1) / n N each way), counted in ``bytes`` and in ``collective_bytes``;
- a custom call (a Pallas kernel, a CPU FFI kernel, a cuBLAS GEMM) counts the bytes it declares
  (a Pallas TPU kernel's ``pl.CostEstimate``, a Triton kernel's ``bytes_accessed`` metadata) or,
  by default, its operands and output once (not a cuBLAS workspace); ``custom_calls`` says which;
- arrays outside device memory (TPU layouts in VMEM, ``S(1)``) move nothing.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from jaxdd.planning.collectives import link_bytes
from jaxdd.planning.hlo_opcodes import (
    COLLECTIVES,
    ELEMENTWISE,
    FREE,
    MOVES,
    SLICING,
    UPDATING,
    VIEWS,
)
from jaxdd.planning.hlo_text import (
    Computation,
    Instruction,
    array_shapes,
    parse_module,
    shape_bytes,
)

STAGES = ("draft", "build", "verify", "accept", "commit", "prefill")
TOP_OPS = 20
# XLA copies the donated state's scalars (lengths, the bonus token) around the round
COPY_MIN_BYTES = 1024
# A quote as printed in a backend config: ", \" (TPU's
# JSON) or \22 (an MLIR string: a Triton call's metadata).
_QUOTE = r'(?:\\22|\\?")?'
_DECLARED = re.compile(rf"bytes_accessed{_QUOTE}\s*:\s*{_QUOTE}([0-9]+)")
_TRIP = re.compile(r'known_trip_count\\?"?\s*:\s*\{\\?"?n\\?"?\s*:\s*\\?"?([0-9]+)')


@dataclasses.dataclass
class _Account:
    # (computation, name) -> record
    ops: dict[tuple[str, str], list] = dataclasses.field(default_factory=dict)
    weights: dict[int, float] = dataclasses.field(default_factory=lambda: defaultdict(float))
    custom_calls: dict[str, dict] = dataclasses.field(default_factory=dict)
    loops: list[dict] = dataclasses.field(default_factory=list)
    conditionals: list[dict] = dataclasses.field(default_factory=list)
    collective_bytes: float = 0.0
    # the entry's, by number
    parameter_bytes: dict[int, int] = dataclasses.field(default_factory=dict)
    # the entry's parameters of a few scalars, however wide their tiles
    small_parameters: set[int] = dataclasses.field(default_factory=set)
    weight_copies: list[dict] = dataclasses.field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(record[2] for record in self.ops.values())

    def add(self, where: str, ins: Instruction, moved: float, stage: str) -> None:
        record = self.ops.setdefault(
            (where, ins.name), [ins.name, ins.opcode, 0.0, stage, ins.op_name]
        )
        record[2] += moved

    def merge(self, other: _Account) -> None:
        for key, (name, op, moved, stage, scope) in other.ops.items():
            self.ops.setdefault(key, [name, op, 0.0, stage, scope])[2] += moved
        for k, v in other.weights.items():
            self.weights[k] += v
        for target, call in other.custom_calls.items():
            mine = self.custom_calls.setdefault(target, {"counted": call["counted"]})
            for key in ("count", "bytes", "on_chip"):
                if key in call:
                    mine[key] = mine.get(key, 0) + call[key]
        self.loops += other.loops
        self.conditionals += other.conditionals
        self.collective_bytes += other.collective_bytes
        self.weight_copies += other.weight_copies


def compiled_traffic(compiled: Any, names: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The traffic account of ``compiled`` (a ``jax.stages.Compiled`` or its HLO text): ``bytes``
    per device, ``by_stage`` (the round's named scopes), ``by_weight`` (bytes read of each entry
    parameter, named by ``names`` from the parameter's argument path, e.g.
    ``models.target_weights[12]``, else by that path), ``top_ops``, what the counting assumed:
    ``custom_calls`` (declared or defaulted), ``loops``, ``conditionals``, and ``weight_copies``:
    instructions that copy a whole parameter (a weight concatenated or relaid inside the round)."""
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    computations, entry = parse_module(text)
    account = _Account()
    main = computations[entry]
    account.parameter_bytes = {
        k: shape_bytes(main.instructions[n].shape) for k, n in main.parameters.items()
    }
    account.small_parameters = {
        k
        for k, n in main.parameters.items()
        if shape_bytes(main.instructions[n].shape, padded=False) < COPY_MIN_BYTES
    }
    _walk(account, computations, main, 1.0, {k: k for k in main.parameters}, "other")
    by_stage = dict.fromkeys((*STAGES, "other"), 0)
    for _, _, moved, stage, _ in account.ops.values():
        by_stage[stage] += round(moved)
    names = names or {}
    by_weight: dict[str, int] = {}
    for number, moved in sorted(account.weights.items(), key=lambda kv: -kv[1]):
        path = main.instructions[main.parameters[number]].op_name or f"parameter {number}"
        if moved >= 1:
            by_weight[names.get(path, path)] = round(moved)
    ranked = sorted(account.ops.values(), key=lambda r: -r[2])[:TOP_OPS]
    path = lambda k: main.instructions[main.parameters[k]].op_name or f"parameter {k}"
    copies = [
        c | {"parameter": names.get(path(c["parameter"]), path(c["parameter"]))}
        for c in account.weight_copies
    ]
    return {
        "bytes": round(account.total),
        "by_stage": by_stage,
        "by_weight": by_weight,
        "top_ops": [
            {"name": n, "op": op, "bytes": round(b), "stage": s, "scope": sc}
            for n, op, b, s, sc in ranked
        ],
        "collective_bytes": round(account.collective_bytes),
        "custom_calls": {
            t: c | {k: round(c[k]) for k in ("bytes", "on_chip") if k in c}
            for t, c in sorted(account.custom_calls.items())
        },
        "loops": account.loops,
        "conditionals": account.conditionals,
        "weight_copies": copies,
    }


def _stage(ins: Instruction, comps: dict[str, Computation], default: str) -> str:
    """The first stage named in the op's scope path; for a fusion without metadata
    (XLA:CPU makes some), the first named by the instructions it fuses."""
    found = next((part for part in ins.op_name.split("/") if part in STAGES), None)
    if found is None and ins.opcode == "fusion" and not ins.op_name:
        fused = comps[ins.called("calls")[0]].instructions.values()
        found = next((s for i in fused if (s := _stage(i, comps, "")) in STAGES), None)
    return found or default


def _walk(
    account: _Account, comps: dict[str, Computation], comp: Computation, scale: float, params, stage
) -> None:
    """Count ``comp`` run ``scale`` times; ``params``: each parameter's
    origin (an entry parameter's number, a tuple of origins, or None),
    so reads of weights are attributed through loops and calls."""
    origins: dict[str, Any] = {}
    for ins in comp.instructions.values():
        origins[ins.name] = _origin(ins, origins, params)
        here = _stage(ins, comps, stage)
        if ins.opcode == "while":
            _loop(account, comps, comp, ins, scale, origins, here)
        elif ins.opcode == "conditional":
            _conditional(account, comps, comp, ins, scale, origins, here)
        elif ins.opcode in ("call", "async-start") and ins.called("calls") + ins.called("to_apply"):
            (callee,) = (ins.called("calls") + ins.called("to_apply"))[:1]
            inner = {k: origins.get(o) for k, o in enumerate(ins.operands)}
            _walk(account, comps, comps[callee], scale, inner, here)
        elif ins.opcode not in FREE:
            reads, writes = _moved(account, comps, comp, ins)
            for operand, moved in reads:
                if isinstance(origins.get(operand), int):
                    account.weights[origins[operand]] += moved * scale
                    _check_copy(account, comps, ins, origins[operand], moved, writes)
            account.add(comp.name, ins, (sum(m for _, m in reads) + writes) * scale, here)


def _check_copy(
    account: _Account, comps, ins: Instruction, parameter: int, moved: float, writes: float
) -> None:
    """Note an instruction that only moves data (a copy, concatenation, transpose,
    or a fusion of such) and reads all of an entry parameter past a few scalars,
    writing as many bytes: a weight (or cache) copied inside the program."""
    size = account.parameter_bytes.get(parameter, 0)
    if size == 0 or parameter in account.small_parameters or moved < size or writes < size:
        return
    fused = comps[ins.called("calls")[0]].instructions.values() if ins.opcode == "fusion" else [ins]
    if all(i.opcode in MOVES for i in fused):
        account.weight_copies.append(
            {"name": ins.name, "op": ins.opcode, "parameter": parameter, "bytes": size}
        )


def _origin(ins: Instruction, origins: dict[str, Any], params: Mapping[int, Any]) -> Any:
    if ins.opcode == "parameter":
        return params.get(int(ins.operand_text))
    if ins.opcode in ("bitcast", "while", "copy-done", "opt-barrier") and ins.operands:
        return origins.get(ins.operands[0])
    if ins.opcode == "tuple":
        return tuple(origins.get(o) for o in ins.operands)
    if ins.opcode == "get-tuple-element":
        source = origins.get(ins.operands[0])
        index = int(ins.attribute("index") or 0)
        return source[index] if isinstance(source, tuple) and index < len(source) else None
    return None


def _moved(
    account: _Account, comps, comp: Computation, ins: Instruction
) -> tuple[list[tuple[str, float]], float]:
    """(operand, bytes read) pairs and bytes written by one instruction."""
    size = lambda name: shape_bytes(comp.instructions[name].shape)
    everything = [(o, size(o)) for o in ins.operands]
    op = ins.opcode.removesuffix("-start")
    if ins.opcode == "fusion":
        fused = comps[ins.called("calls")[0]]
        reads = [
            (o, min(size(o), _param_reads(comps, fused, k))) for k, o in enumerate(ins.operands)
        ]
        return reads, _fusion_writes(comps, fused, ins.shape)
    if op in COLLECTIVES:
        # What crosses the link, wherever the buffers live (a TPU's may be in VMEM).
        last = len(array_shapes(ins.shape)) - 1 if ins.shape.startswith("(") else None
        sent = sum(shape_bytes(comp.instructions[o].shape, anywhere=True) for o in ins.operands)
        link = link_bytes(op, sent, shape_bytes(ins.shape, last, anywhere=True), ins)
        account.collective_bytes += link
        return [], link
    if ins.opcode == "custom-call":
        # operands XLA:TPU prefetched on chip (VMEM): their copy-start read them from HBM
        on_chip = {o for o in ins.operands if size(o) == 0}
        prefetched = sum(shape_bytes(comp.instructions[o].shape, anywhere=True) for o in on_chip)
        return _custom_call(account, ins, everything, _custom_call_output(ins), prefetched)
    if ins.opcode in SLICING:
        out = shape_bytes(ins.shape)
        return [(ins.operands[0], out), *everything[1:]], out
    if ins.opcode in UPDATING:
        update = size(_update(ins))
        return [(o, m) for o, m in everything[1:] if o != _update(ins)] + [
            (_update(ins), update)
        ], update
    if ins.opcode == "copy-start":
        return everything, shape_bytes(ins.shape, 0)
    return everything, shape_bytes(ins.shape)


def _update(ins: Instruction) -> str:
    """The update operand of a dynamic-update-slice (operand,
    update, indices...) or scatter (operand, indices, updates)."""
    return ins.operands[1] if ins.opcode == "dynamic-update-slice" else ins.operands[-1]


def _param_reads(comps: dict[str, Computation], fused: Computation, number: int) -> float:
    """Bytes a fused computation reads of its parameter ``number``: what its slices
    and gathers take of it (through the elementwise ops and views between, which a
    fusion evaluates only where its output needs them), what nested fusions read of
    it, nothing where it is a buffer updated in place, all of it otherwise."""
    name = fused.parameters[number]
    return min(1.0, _touched(comps, fused, name)) * shape_bytes(fused.instructions[name].shape)


def _touched(comps: dict[str, Computation], fused: Computation, name: str) -> float:
    """The fraction of the value ``name`` that its users
    inside ``fused`` touch (summed over users)."""
    # the output (a nested fusion's: what its consumer reads) is all of it
    total = 1.0 if name == fused.root else 0.0
    elements = _elements(fused.instructions[name].shape)
    for user, position in fused.users(name):
        if user.opcode in SLICING and position == 0:
            total += _elements(user.shape) / max(elements, 1)
        elif user.opcode in UPDATING and position == 0:
            continue
        elif user.opcode in VIEWS or (
            user.opcode in ELEMENTWISE and _elements(user.shape) == elements
        ):
            total += _touched(comps, fused, user.name)
        elif user.opcode == "fusion":
            nested = comps[user.called("calls")[0]]
            total += _param_reads(comps, nested, position) / max(
                shape_bytes(fused.instructions[name].shape), 1
            )
        else:
            total += 1.0
        if total >= 1.0:
            return 1.0
    return total


def _elements(shape: str) -> int:
    return sum(math.prod(dims) for _, dims, _ in array_shapes(shape))


def _fusion_writes(comps: dict[str, Computation], fused: Computation, shape: str) -> float:
    """Bytes a fusion writes: each output array, or the update of one updated in place."""
    root = fused.instructions[fused.root]
    elements = root.operands if root.opcode == "tuple" else [root.name]
    layouts = [layout for _, _, layout in array_shapes(shape)]
    total = 0.0
    for k, element in enumerate(elements):
        if k < len(layouts) and ":" in layouts[k] and shape_bytes(shape, k) == 0:
            continue  # outside device memory
        total += _written(comps, fused, fused.instructions[element])
    return total


def _written(comps: dict[str, Computation], fused: Computation, ins: Instruction) -> float:
    if ins.opcode in UPDATING:
        return shape_bytes(fused.instructions[_update(ins)].shape)
    if ins.opcode in VIEWS:
        return _written(comps, fused, fused.instructions[ins.operands[0]])
    if ins.opcode == "fusion":
        return _fusion_writes(comps, comps[ins.called("calls")[0]], ins.shape)
    return shape_bytes(ins.shape)


def _custom_call_output(ins: Instruction) -> float:
    """A custom call's output bytes; a cuBLAS or cuDNN call's trailing s8 array
    is its scratch workspace, which it need not touch in full: not counted."""
    arrays = array_shapes(ins.shape)
    library = (ins.attribute("custom_call_target") or "").startswith(("__cublas", "__cudnn"))
    if library and len(arrays) > 1 and arrays[-1][0] == "s8":
        return sum(shape_bytes(ins.shape, k) for k in range(len(arrays) - 1))
    return shape_bytes(ins.shape)


def _custom_call(
    account: _Account, ins: Instruction, everything, output: float, prefetched: float = 0.0
):
    """A custom call's bytes: what it declares (a Pallas kernel's CostEstimate) less what it
    reads of operands already on chip (``prefetched``: a copy-start counted their HBM read, or
    XLA computed them there; listed as ``on_chip``), else its operands and output."""
    target = ins.attribute("custom_call_target") or "?"
    declared = _DECLARED.search(ins.backend_config)
    call = account.custom_calls.setdefault(target, {"count": 0, "bytes": 0.0, "counted": ""})
    call["count"] += 1
    if declared is not None:
        call["counted"] = "declared"
        moved = max(0.0, float(declared.group(1)) - prefetched)
        call["bytes"] += moved
        call["on_chip"] = call.get("on_chip", 0.0) + float(declared.group(1)) - moved
        return [], moved
    call["counted"] = "defaulted"
    call["bytes"] += sum(m for _, m in everything) + output
    return everything, output


def _loop(
    account: _Account, comps, comp: Computation, ins: Instruction, scale: float, origins, stage
) -> None:
    trips, source = _trip_count(comps, comp, ins)
    account.loops.append({"name": ins.name, "trip_count": trips, "source": source})
    carried = {0: origins.get(ins.operands[0])}
    _walk(account, comps, comps[ins.called("body")[0]], scale * (trips or 1), carried, stage)
    _walk(
        account,
        comps,
        comps[ins.called("condition")[0]],
        scale * ((trips or 1) + 1),
        carried,
        stage,
    )


def _trip_count(
    comps: dict[str, Computation], comp: Computation, ins: Instruction
) -> tuple[int | None, str]:
    """A loop's trips: XLA's ``known_trip_count``, else ``limit - start`` of an induction
    variable that the condition compares (LT) with a constant and the loop starts from a
    constant (steps of one, as ``fori_loop`` and ``scan`` make); None when neither is found."""
    known = _TRIP.search(ins.backend_config)
    if known is not None:
        return int(known.group(1)), "known_trip_count"
    condition = comps[ins.called("condition")[0]]
    root = condition.instructions[condition.root]
    init = comp.instructions.get(ins.operands[0])
    if (
        root.opcode != "compare"
        or "direction=LT" not in root.attributes
        or init is None
        or init.opcode != "tuple"
    ):
        return None, "unknown (counted once)"
    left, right = (condition.instructions[o] for o in root.operands)
    if left.opcode == "get-tuple-element" and right.opcode == "constant":
        start = comp.instructions.get(init.operands[int(left.attribute("index") or 0)])
        while start is not None and start.opcode == "copy":
            start = comp.instructions.get(start.operands[0])
        if start is not None and start.opcode == "constant":
            return int(right.operand_text) - int(start.operand_text), "induction variable"
    return None, "unknown (counted once)"


def _conditional(
    account: _Account, comps, comp: Computation, ins: Instruction, scale: float, origins, stage
):
    branches = ins.called("branch_computations") or ins.called("true_computation") + ins.called(
        "false_computation"
    )
    accounts = []
    for k, branch in enumerate(branches):
        sub = _Account()
        _walk(sub, comps, comps[branch], scale, {0: origins.get(ins.operands[k + 1])}, stage)
        accounts.append(sub)
    counted = max(range(len(accounts)), key=lambda k: accounts[k].total)
    branch_bytes = [round(a.total) for a in accounts]
    counted_as = f"branch {counted} (the larger)"
    account.conditionals.append(
        {"name": ins.name, "branch_bytes": branch_bytes, "counted": counted_as}
    )
    account.merge(accounts[counted])
