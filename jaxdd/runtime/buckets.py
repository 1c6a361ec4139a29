"""The static sizes requests are padded to (batch and prompt buckets; the cache's are in
``jaxdd.cache``): shapes repeat, so each compiles once. The CLI's batches and the server's rows
pad with the same functions."""

from __future__ import annotations

MIN_BUCKET = 16
# 4: a server warms up a prefill per bucket and kind, each XLA:CPU program costing hundreds of
# the process's memory maps (jaxdd/decoding/memory_maps.py); 8 took its defaults past them
PROMPT_BUCKETS_PER_OCTAVE = 4
PROMPT_MIN_STEP = 16  # prompt sizes are multiples of this (short prompts: fewer shapes to compile)


def bucket(n: int, minimum: int = MIN_BUCKET, per_octave: int = 1, min_step: int = 1) -> int:
    """The static size used for n, at least ``minimum``: the next power of two, or the
    next of ``per_octave`` evenly spaced sizes per octave (4: ..., 64, 80, 96, 112, 128,
    160, ...), less padding for more shapes; sizes are multiples of ``min_step``."""
    power = max(minimum, 1 << (max(n, 1) - 1).bit_length())
    step = max(min_step, power // (2 * per_octave))
    return max(minimum, -(-n // step) * step)


def prompt_bucket(length: int) -> int:
    """The padded length a prompt of ``length`` tokens is
    prefilled at (quarter octaves, multiples of 16)."""
    return bucket(length, per_octave=PROMPT_BUCKETS_PER_OCTAVE, min_step=PROMPT_MIN_STEP)


def prompt_buckets(max_prompt: int) -> list[int]:
    """Every padded length a prompt of up to ``max_prompt`` tokens is prefilled at."""
    return sorted({prompt_bucket(n) for n in range(1, max_prompt + 1)})


def round_tiers(rows: int) -> tuple[int, ...]:
    """The row counts a pool of ``rows`` runs rounds over: the first 1, 4, 16, ... rows and all
    of them (requests take the lowest free row, so a round runs up to the highest busy one)."""
    return tuple(sorted({4**i for i in range(rows.bit_length()) if 4**i < rows} | {rows}))
