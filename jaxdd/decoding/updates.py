"""A pool's device reports read into its rows' updates (``jaxdd.decoding.rows``): each report
names the rows it was run for and the requests that held them then, so a row's update only ever
reaches the request whose round it was."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax

from jaxdd.decoding.report import RoundReport
from jaxdd.decoding.requests import RowEntry, RowUpdate
from jaxdd.decoding.speculation import Ticket


class DeviceReport(NamedTuple):
    """A device report, its top-k trace width and logprobs' top-k, the prompt positions it scored,
    for each row it was run for (row, its line in the report, the request holding it), its tokens
    per row, a round's ticket (None: a prefill's, or warm-up's), and the draft tokens its round
    proposed per row (0: a prefill's or a plain round's)."""

    report: jax.Array
    trace: int
    top_logprobs: int
    scored: int
    holders: list[tuple[int, int, RowEntry]]
    width: int
    ticket: Ticket | None = None
    proposed: int = 0


def read_updates(
    reports: list[DeviceReport],
    holder: Callable[[int], RowEntry | None],
    emitted: Callable[[Ticket, list[int]], None],
) -> tuple[dict[int, RowUpdate], list[int]]:
    """``reports`` (in dispatch order) read into each row's update, for rows ``holder`` says the
    same request still holds, counting the tokens into its entry; and the rows that ended, in the
    order they did (a later report's line for a row that ended is nobody's). Each round's tokens
    per row it ran for go to ``emitted`` with its ticket."""
    updates: dict[int, RowUpdate] = {}
    ended: list[int] = []
    for device_report, trace, top_logprobs, scored, holders, width, ticket, proposed in reports:
        report = RoundReport.decode(device_report, width, trace, top_logprobs, scored)
        if ticket is not None:
            emitted(ticket, [len(report.emitted(i)) for _, i, _ in holders])
        for row, index, entry in holders:
            # released, or already finished by an earlier report
            if holder(row) is not entry or row in ended:
                continue
            update = dataclasses.replace(_update(report, index, entry), proposed=proposed)
            if row in updates:
                update = updates[row].then(update)
            trace = None if report.trace is None or not update.tokens else report.trace[index]
            updates[row] = dataclasses.replace(update, trace=trace)
            if update.finish is not None:
                ended.append(row)
    return updates, ended


def _update(report: RoundReport, index: int, entry: RowEntry) -> RowUpdate:
    """Line ``index`` of ``report`` as its request's update, its tokens counted into ``entry``."""
    # a request for no new tokens (its prompt scored alone) keeps not even the first
    emitted = report.emitted(index)
    tokens = emitted[: entry.max_new_tokens - entry.produced]
    first = entry.produced == 0 and bool(tokens)
    entry.produced += len(tokens)
    entry.output += tokens
    # a stop token cut off by the length is not the reason it ended
    stopped = bool(report.stopped[index]) and len(tokens) == len(emitted)
    finish = "stop" if stopped else None
    if not stopped and entry.produced >= entry.max_new_tokens:
        finish = "length"
    scores, prompt_scores = report.scores(index, len(tokens), entry.logprobs, entry.scored_prompt)
    counts = (entry.produced, entry.owner, scores, prompt_scores, entry.cached_tokens)
    return RowUpdate(tokens, finish, first, None, *counts)
