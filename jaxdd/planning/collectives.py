"""What a collective moves over the link: the bytes one device sends plus those it receives, for
ring algorithms over the collective's replica group (``compiled_traffic`` counts them)."""

from __future__ import annotations

import math
import re

from jaxdd.planning.hlo_text import Instruction


def link_bytes(op: str, operands: float, output: float, ins: Instruction) -> float:
    """Bytes a collective sends plus those it receives,
    per device, for ring algorithms over its group."""
    n = group_size(ins)
    if n <= 1 and op != "collective-permute":
        return 0.0
    share = (n - 1) / n
    if op == "all-reduce":
        # reduce-scatter then all-gather, each sending and receiving (n-1)/n
        return 4 * share * operands
    if op == "all-gather":
        return 2 * share * output
    if op in ("reduce-scatter", "all-to-all"):
        return 2 * share * operands
    # collective-permute / -broadcast: send the operand, receive the output
    return operands + output


def group_size(ins: Instruction) -> int:
    """Devices in each of the collective's replica groups: ``{{0,1,...}}``,
    the iota form ``[groups,size]<=[n]``, or the mesh form
    ``mesh['a'=1,'b'=8] {'b'}`` (the named axes' sizes multiplied)."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", ins.attributes)
    if mesh is not None:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=([0-9]+)", mesh.group(1))}
        return math.prod(sizes[a] for a in re.findall(r"'([^']+)'", mesh.group(2)))
    groups = re.search(
        r"replica_groups=(\{\{[^=]*?\}\}|\[[0-9,]+\]<=\[[0-9,]+\][^,]*)", ins.attributes
    )
    if groups is None:
        return 1
    text = groups.group(1)
    if text.startswith("["):  # iota form [groups, size]<=[devices]
        return int(text[1:].split("]")[0].split(",")[-1])
    return len(text.split("}")[0].strip("{").split(","))
