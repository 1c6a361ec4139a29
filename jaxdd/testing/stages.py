"""Where a real round spends its time, by stage: the profiler's per-op events
attributed to the ``named_scope`` of the round's stages (``jaxdd.decoding.rounds``:
draft, build, verify, accept, commit) through the compiled HLO's metadata.

This measures the round that decoding runs, not a copy rebuilt from stage
functions. Ops run concurrently on the backend's threads, so a stage's
time is the sum of its ops' durations ("op time"), not wall time.
"""

from __future__ import annotations

import re
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import jax

from jaxdd.testing.rounds import BatchRound

STAGES = ("draft", "build", "verify", "accept", "commit")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$", re.M)
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_OPERAND = re.compile(r"%([\w.\-]+)")


def op_stages(hlo_text: str) -> dict[str, str]:
    """Each HLO instruction's stage: the first stage name in its op_name scope path.
    Instructions that XLA made without metadata (e.g. the CPU backend's rewritten
    dots) take the stage of their first operand that has one; the rest are "other"."""
    stages = {}
    operands = {}
    for name, rest in _INSTRUCTION.findall(hlo_text):
        op_name = _OP_NAME.search(rest)
        if op_name:
            stages[name] = next((s for s in op_name.group(1).split("/") if s in STAGES), "other")
        else:
            operands[name] = _OPERAND.findall(rest.split("metadata=")[0])
    for _ in range(8):  # a chain of metadata-less instructions resolves one link per pass
        for name, names in operands.items():
            if name not in stages:
                known = [stages[o] for o in names if stages.get(o, "other") != "other"]
                if known:
                    stages[name] = known[0]
    return stages


def stage_op_ms(
    hlo_text: str, module: str, run: Callable[[], object], calls: int
) -> dict[str, float]:
    """Milliseconds of op time per stage and call, profiling ``calls`` calls
    of ``run`` (each must wait for its results) of the executable ``module``
    (e.g. "jit_decode_round") whose compiled HLO is ``hlo_text``."""
    stages = op_stages(hlo_text)
    totals: dict[str, float] = defaultdict(float)
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory):
            for _ in range(calls):
                run()
        (trace,) = Path(directory).rglob("*.xplane.pb")
        profile = jax.profiler.ProfileData.from_file(str(trace))
    for plane in profile.planes:
        for line in plane.lines:
            for name, ns in _innermost_ops(line.events, module):
                totals[stages.get(name, "other")] += ns
    return {f"{stage}_ms": totals[stage] / calls / 1e6 for stage in (*STAGES, "other")}


def _innermost_ops(events, module: str):
    """(op name, duration ns) of one thread's op events of ``module``, leaving out those that
    contain another (a loop's thunk holds its body's: counting both would count the body twice)."""
    ops = []
    for event in events:
        stats = dict(event.stats)
        if stats.get("hlo_module") == module and "hlo_op" in stats:
            ops.append((event.start_ns, event.start_ns + event.duration_ns, stats["hlo_op"]))
    ops.sort()
    for i, (start, end, name) in enumerate(ops):
        if i + 1 < len(ops) and ops[i + 1][0] < end:
            continue
        yield name, end - start


def round_stages(batch_round: BatchRound, calls: int = 20) -> dict[str, float]:
    """Op milliseconds per stage of ``batch_round``'s compiled round, run ``calls`` times from
    copies of the state after its prefill (the round donates its state), after one warm-up
    call."""
    copies = batch_round.copies(calls + 1)
    hlo = batch_round.lower().compile().as_text()
    run = lambda: jax.block_until_ready(batch_round(copies.pop()))
    run()
    return stage_op_ms(hlo, "jit_decode_round", run, calls)
