"""A batch round's size, checked before it runs: its working memory against what the devices have
free, and a note when it verifies far more tokens than it can accept."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import jax

from jaxdd.decoding.state import DecodeState, RoundSpec, RowSettings
from jaxdd.errors import InputError, LargeRoundWarning
from jaxdd.runtime.backend import Backend
from jaxdd.types import verified_tokens

# A DDTree round past this many nodes per drafted position gets a note: deeper candidates are rarely
# accepted (tau per budget: benchmarks/README.md, "HumanEval"), each costs verify work.
NODES_PER_POSITION_NOTE = 16


class RoundSizes:
    """The working memory of each round shape a decoder compiled (lowering again, even for a
    cached executable, costs more than a round)."""

    def __init__(self) -> None:
        self._bytes: dict[tuple, int] = {}

    def check(
        self,
        lower: Callable[[], jax.stages.Lowered],
        spec: RoundSpec,
        state: DecodeState,
        settings: RowSettings,
        trained: int | None,
    ) -> None:
        """Compile the round (``lower``; ``step`` then reuses it) and refuse it, naming the option
        that sizes it, when its working memory is more than the devices have free; warn
        (``LargeRoundWarning``) when it verifies far more tokens than it can accept.
        Without the check an oversized round dies of an out-of-memory traceback, and a
        merely huge one runs at a fraction of a token per second without a word. ``trained``:
        the drafter's trained block."""
        verified = verified_tokens(spec.method, spec.block, spec.budget)
        option = {
            "ar": "the batch",
            "dflash": f"block_size {spec.block}",
            "ddtree": f"budget {spec.budget}",
        }
        asked = option[spec.method]
        what = f"the {spec.method} round verifies {verified} tokens per request ({asked})"
        # once per round shape: lowering again (even a cached executable) costs more than a round
        key = (
            spec,
            tuple((x.shape, x.dtype, x.sharding) for x in jax.tree.leaves((state, settings))),
        )
        if key not in self._bytes:
            try:
                stats = lower().compile().memory_analysis()
            except jax.errors.JaxRuntimeError as error:  # GPU/TPU compilers refuse what cannot fit
                if "RESOURCE_EXHAUSTED" not in str(error):
                    raise
                raise InputError(
                    f"{what} and does not fit the device: {str(error).splitlines()[0]}"
                ) from None
            self._bytes[key] = stats.temp_size_in_bytes if stats is not None else 0
        needed = self._bytes[key]
        free = Backend.free_bytes(state.bonus.sharding.addressable_devices)  # this process's
        if free is not None and needed > free:
            raise InputError(
                f"{what} and needs {gigabytes(needed)} of working memory per device, "
                f"{gigabytes(free)} is free; lower {option[spec.method].split()[0]}"
            )
        if spec.method != "ar" and spec.block > trained:
            note = (
                f"past the drafter's trained block of {trained} (its later positions are untrained)"
            )
        elif spec.method == "ddtree" and spec.budget > NODES_PER_POSITION_NOTE * (spec.block - 1):
            note = (
                f"to accept at most {spec.block}: over {NODES_PER_POSITION_NOTE} nodes per "
                f"drafted position"
            )
        else:
            return
        warnings.warn(
            f"{what} {note}; it needs {gigabytes(needed)} of working memory per device",
            LargeRoundWarning,
            3,
        )


def gigabytes(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
