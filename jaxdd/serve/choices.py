"""A request's rows as they come back: each choice's text (stop strings applied), finish reason and
logprobs, counted in the metrics as each row ends, and sent whole or as an SSE stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request

from jaxdd.serve import protocol
from jaxdd.serve.jobs import APIError, Asked, Server
from jaxdd.serve.logprobs import ChoiceLogprobs
from jaxdd.serve.output import Output
from jaxdd.serve.scheduler import Event, Job

DISCONNECT_POLL = 0.25  # seconds between a non-streaming request's looks at its connection


class Choices:
    """A request's rows as they come: each one's output, finish reason and logprobs (if asked),
    and the token counts (in the request's ``state.usage`` too, for the access log)."""

    def __init__(
        self,
        server: Server,
        kind: Literal["completion", "chat"],
        jobs: list[Job],
        stops: list[str],
        prompt_tokens: int,
        state: Any,
        asked: Asked,
    ):
        self.server = server
        self.jobs = jobs
        self.state = state
        self.outputs = [Output(server.tokenizer, set(job.request.stop_ids), stops) for job in jobs]
        self.finishes: list[str | None] = [None] * len(jobs)
        self.logprobs = [
            None if asked.logprobs is None else ChoiceLogprobs(server.tokenizer, kind) for _ in jobs
        ]
        self.echoes: list[str | None] = [None] * len(jobs)  # each choice's, until it is sent
        self.prompt_tokens = prompt_tokens
        state.usage = (prompt_tokens, 0)

    def echo(self, texts: list[str]) -> None:
        """Each choice's text begins with its prompt's (one per row)."""
        self.echoes = list(texts)

    @property
    def done(self) -> bool:
        return all(finish is not None for finish in self.finishes)

    def take(self, index: int, event: Event) -> tuple[str, dict | None]:
        """Row ``index``'s new text (its echoed prompt's first) and, if asked, the logprobs of
        its new tokens (``take``: an engine error raises)."""
        output = self.outputs[index]
        before = len(output.token_ids)
        try:
            delta, self.finishes[index] = take(self.server, event, output, self.jobs[index])
        except APIError:
            self.finishes[index] = "error"  # counted by take
            raise
        self.state.usage = (self.prompt_tokens, self.completion_tokens)
        echo = self.echoes[index]
        self.echoes[index] = None  # sent with this event
        choice_logprobs = self.logprobs[index]
        if choice_logprobs is None:
            return (echo or "") + delta, None
        parts = []
        if echo is not None and event.prompt_logprobs is not None:
            prompt = self.jobs[index].request.prompt
            parts.append(choice_logprobs.add_prompt(prompt, event.prompt_logprobs))
        new = output.token_ids[before:]  # a stop string may end the output inside the event
        parts.append(choice_logprobs.add(new, (event.logprobs or [])[: len(new)]))
        return (echo or "") + delta, choice_logprobs.joined(parts)

    @property
    def completion_tokens(self) -> int:
        return sum(len(output.token_ids) for output in self.outputs)

    def usage(self) -> dict:
        return protocol.usage(
            self.prompt_tokens, self.completion_tokens, sum(j.cached_tokens for j in self.jobs)
        )

    def end(self, reason: str) -> None:
        """Cancel every row; count those that had not finished as ending for ``reason``."""
        for index, job in enumerate(self.jobs):
            job.cancel()
            if self.finishes[index] is None:
                self.finishes[index] = reason
                self.server.scheduler.metrics.finished.labels(reason).inc()


def take(server: Server, event: Event, output: Output, job: Job) -> tuple[str, str | None]:
    """(the text to release, the finish reason: the engine's, or "stop" for a
    stop string); an engine error raises. The request's end is counted here."""
    finished = server.scheduler.metrics.finished
    if event.error is not None:
        finished.labels("error").inc()
        raise APIError(500, event.error, "server_error")
    delta = output.add(event.tokens, final=event.finish is not None)
    if output.stopped:
        job.cancel()  # the row is freed before the next round
        finished.labels("stop").inc()
        return delta, "stop"
    if event.finish is not None:
        finished.labels(event.finish).inc()
    return delta, event.finish


async def watch_disconnect(request: Request, events: asyncio.Queue) -> None:
    """Put None in ``events`` once the client has disconnected
    (looked at every ``DISCONNECT_POLL`` seconds)."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL)
    events.put_nowait(None)


async def stream(
    server: Server, kind, body, choices: Choices, events, request_id: str
) -> AsyncIterator[str]:
    """The SSE chunks of a streamed request, each of one choice (its ``index``); closing the
    generator (the client left) cancels the request."""
    usage_field = {"usage": None} if body.include_usage else {}
    first = [True] * len(choices.jobs)
    reason = "abort"  # how rows still running end when the generator closes: the client left
    try:
        while not choices.done:
            index, event = await events.get()
            output = choices.outputs[index]
            before = len(output.token_ids)
            try:
                delta, logprobs = choices.take(index, event)
            except APIError as error:
                reason = "error"
                yield sse(error.body)
                break
            ids = output.token_ids[before:] if body.return_token_ids else None
            finish = choices.finishes[index]
            if kind == "chat":
                choice = protocol.chat_choice(
                    delta, finish, ids, index, delta=True, first=first[index], logprobs=logprobs
                )
            else:
                choice = protocol.completion_choice(delta, finish, ids, index, logprobs)
            first[index] = False
            yield sse(
                protocol.body(kind, request_id, server.model, [choice], chunk=True, **usage_field)
            )
        if body.include_usage and choices.done:
            usage = choices.usage()
            yield sse(protocol.body(kind, request_id, server.model, [], chunk=True, usage=usage))
        yield "data: [DONE]\n\n"
    finally:
        choices.end(reason)


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
