"""Hypothesis profiles. ``ci``, the default, is derandomized and keeps no example
database, so a commit passes or fails the same way on every run and machine; ``thorough``
(``HYPOTHESIS_PROFILE=thorough``) draws fresh random examples, ``THOROUGH`` times as
many, for a run by hand before a release. Both print how to reproduce a failure."""

from __future__ import annotations

import os

from hypothesis import settings

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
THOROUGH = 25

settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile(
    "thorough", database=None, deadline=None, print_blob=True, max_examples=100 * THOROUGH
)


def examples(count: int) -> int:
    """A test's example count under the chosen profile:
    ``count`` in CI, ``THOROUGH`` times it when thorough."""
    return count * THOROUGH if PROFILE == "thorough" else count


def load() -> None:
    """Load the chosen profile (``tests/conftest.py`` calls this before any test is collected)."""
    if PROFILE not in ("ci", "thorough"):
        raise ValueError(f"HYPOTHESIS_PROFILE: expected ci or thorough, got {PROFILE!r}")
    settings.load_profile(PROFILE)
