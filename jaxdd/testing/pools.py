"""A request run alone through a ``RowPool``, round by round, as the tests drive one."""

from __future__ import annotations

from jaxdd.decoding.requests import RowRequest
from jaxdd.decoding.rows import RowPool


def run_alone(pool: RowPool, request: RowRequest) -> tuple[list[int], list[int], int]:
    """``request`` alone through ``pool``: its tokens, how many each update brought, and the
    prompt tokens it found cached."""
    pool.admit([pool.check(request)])
    tokens, sizes, cached = [], [], 0
    # bounded: a round brings a token or more, or a chunk of the prompt
    for _ in range(request.max_new_tokens + len(request.prompt) + 1):
        if not pool.busy:
            break
        for update in pool.step().values():
            tokens += update.tokens
            sizes.append(len(update.tokens))
            cached += update.cached_tokens if update.first else 0
    assert not pool.busy, "a request outlived its rounds"
    return tokens, sizes, cached
