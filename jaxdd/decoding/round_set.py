"""The rounds one pool runs on its one decode state: its method's alone, or with ``auto`` a small
set the chooser (``jaxdd.decoding.speculation``) picks from each round, every one compiled in
warm-up. DDTree: the budget, half of it and plain decoding; DFlash: the block and plain decoding.
All share the state's shapes (the drafter's block; the largest round's pages), and a plain round
in it keeps the drafter's context whole (``rounds._ar_step``), so each round is lossless on its
own whatever the sequence."""

from __future__ import annotations

import dataclasses

from jaxdd.decoding.requests import Decoder
from jaxdd.decoding.speculation import PLAIN
from jaxdd.decoding.state import RoundSpec
from jaxdd.errors import InputError
from jaxdd.types import Method

AUTO_ROUNDS: dict[Method, int] = {"ar": 1, "dflash": 2, "ddtree": 3}  # the most a set holds


def round_name(spec: RoundSpec) -> str:
    """The spec as ``/metrics`` names it: ``ar``, ``dflash-8``, ``ddtree-16``."""
    if spec.method == "ar":
        return PLAIN
    return f"{spec.method}-{spec.budget if spec.method == 'ddtree' else spec.block}"


@dataclasses.dataclass(frozen=True)
class RoundSet:
    """Each round by name (the largest first), as its sampled and its greedy spec."""

    sampled: dict[str, RoundSpec]
    greedy: dict[str, RoundSpec]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.sampled)

    def spec(self, name: str, sampled: bool) -> RoundSpec:
        return (self.sampled if sampled else self.greedy)[name]

    def specs(self) -> list[RoundSpec]:
        """Every spec, the sampled ones first."""
        return [*self.sampled.values(), *self.greedy.values()]


def round_set(decoder: Decoder, spec: RoundSpec, greedy: RoundSpec, auto: bool) -> RoundSet:
    """``spec`` (sampled) and ``greedy`` alone, or with ``auto`` and the smaller rounds of the
    set; ``InputError`` for auto with plain decoding (nothing to choose)."""
    variants = [{}]
    if auto:
        if spec.method == "ar":
            raise InputError.at("budget", "auto chooses among speculative rounds: not for ar")
        half = spec.budget // 2 if spec.method == "ddtree" else 0
        variants += [{"budget": half}] if half >= 1 else []
        variants.append({"method": "ar", "block": 1, "budget": None, "trace": 0})
    sampled, greedies = {}, {}
    for change in variants:
        one, other = (dataclasses.replace(s, **change) for s in (spec, greedy))
        sampled[round_name(one)], greedies[round_name(one)] = one, other
    return RoundSet(sampled, greedies)
