"""The HTTP side: FastAPI routes for the OpenAI endpoints,
Server-Sent Events for streams, OpenAI error bodies.

Every request is checked before it is queued (a 400 names the field); past
``--max-waiting`` it gets a 429. A stream whose client goes away cancels its request
(the generator is closed), and so does a non-streaming request whose client disconnects
(polled while it waits), so its row is free for the next round. Each refusal and each
end (``take``, or the client leaving: "abort") is counted in the metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from jaxdd.decoding.checks import MAX_STOP_TOKENS
from jaxdd.decoding.sampling import Sampling
from jaxdd.errors import InputError
from jaxdd.serve import errors, protocol
from jaxdd.serve.output import Output
from jaxdd.serve.scheduler import Event, Job, NotReady, QueueFull, Scheduler
from jaxdd.weights.tokenizer import TextTokenizer, render_chat_template

DISCONNECT_POLL = 0.25  # seconds between a non-streaming request's looks at its connection
# the request field behind a jaxdd field that the API names otherwise
API_PARAMS = {"token_ids": "prompt"}


@dataclasses.dataclass
class Server:
    scheduler: Scheduler
    tokenizer: TextTokenizer | None
    model: str
    stop_ids: list[int]  # always stop here (EOS, end of turn); requests add their own
    chat_template: str | None
    request_timeout: float | None


class APIError(Exception):
    """An error answer; ``refused``: why the request was refused (``metrics.REFUSALS``), None for
    a 500."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param=None,
        code=None,
        refused: str | None = None,
    ):
        super().__init__(message)
        self.status, self.body = status, protocol.error_body(message, kind, param, code)
        self.refused = refused or ("invalid" if status < 500 else None)


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="jaxdd", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def api_error(_, error: APIError):
        if error.refused is not None:
            server.scheduler.metrics.refused.labels(error.refused).inc()
        return JSONResponse(error.body, status_code=error.status)

    @app.get("/health")
    async def health():
        if server.scheduler.failure is not None:
            return errors.error_json(503, server.scheduler.failure, "server_error")
        if not server.scheduler.ready.is_set():
            return errors.error_json(503, "compiling", "server_error", code="not_ready")
        if server.scheduler.draining:
            return errors.error_json(503, "shutting down", "server_error", code="draining")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.scheduler.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        card = {"id": server.model, "object": "model", "created": 0, "owned_by": "jaxdd"}
        return {"object": "list", "data": [{**card, "max_model_len": server.scheduler.max_len}]}

    @app.post("/v1/completions")
    async def completions(body: protocol.CompletionRequest, request: Request):
        text = isinstance(body.prompt, str)
        prompt = encode(server, body.prompt, special=False) if text else list(body.prompt)
        return await generate(server, "completion", body, prompt, body.max_tokens, request)

    @app.post("/v1/chat/completions")
    async def chat(body: protocol.ChatRequest, request: Request):
        if server.chat_template is None:
            raise APIError(
                400, "this model has no chat template (start the server with --chat-template FILE)"
            )
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        special = {"bos_token": server.tokenizer.named_token("bos_token") or ""}
        special["eos_token"] = server.tokenizer.named_token("eos_token") or ""
        try:
            text = render_chat_template(server.chat_template, messages, **special)
        except InputError as error:
            raise APIError(400, str(error), param="messages") from None
        prompt = encode(server, text, special=True)
        return await generate(
            server, "chat", body, prompt, body.max_completion_tokens or body.max_tokens, request
        )

    errors.install(app, lambda reason: server.scheduler.metrics.refused.labels(reason).inc())
    return app


def encode(server: Server, text: str, special: bool) -> list[int]:
    if server.tokenizer is None:
        raise APIError(
            400, "this model has no tokenizer: give the prompt as token ids", param="prompt"
        )
    ids = server.tokenizer.encode(text, special=special)
    if not ids:
        raise APIError(400, "the prompt has no tokens", param="prompt")
    return ids


def make_job(
    server: Server,
    body: protocol.SamplingFields,
    prompt: list[int],
    max_tokens: int | None,
    deliver,
):
    """The request's job, checked against what the server runs (APIError 400 / 404 otherwise)."""
    if body.model is not None and body.model != server.model:
        raise APIError(404,
                       f"model {body.model!r} does not exist; this server has {server.model!r}",
                       param="model", code="model_not_found")  # fmt: skip
    if body.stop_strings() and server.tokenizer is None:
        raise APIError(
            400, "stop strings need a tokenizer; this model has none: give stop ids", param="stop"
        )
    if max_tokens is None:
        max_tokens = server.scheduler.max_len - len(prompt)
        if max_tokens < 1:
            limit = server.scheduler.max_len
            message = f"prompt: {len(prompt)} tokens leaves no room in --max-len {limit}"
            raise APIError(400, message, refused="too_long")
    stop_ids = sorted(set(server.stop_ids) | set(body.stop_ids()))
    if len(stop_ids) > MAX_STOP_TOKENS:
        own, added = len(set(server.stop_ids)), len(set(body.stop_ids()) - set(server.stop_ids))
        message = f"at most {MAX_STOP_TOKENS - own} beside this model's {own} own, got {added}"
        raise APIError(400, f"stop_token_ids: {message}", param="stop_token_ids")
    seed = secrets.randbelow(2**32) if body.seed is None else body.seed
    sampling = Sampling(body.temperature, body.top_p, max(body.top_k, 0), seed)
    try:
        request = server.scheduler.check(prompt, max_tokens, stop_ids, sampling)
    except InputError as error:
        refused = "too_long" if server.scheduler.too_long(prompt, max_tokens) else "invalid"
        param = API_PARAMS.get(error.field, error.field)
        raise APIError(400, str(error), param=param, refused=refused) from None
    timeouts = [t for t in (body.timeout, server.request_timeout) if t is not None]
    return Job(request, deliver, timeout=min(timeouts) if timeouts else None)


async def generate(
    server: Server, kind: Literal["completion", "chat"], body, prompt, max_tokens, request: Request
):
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    job = make_job(
        server,
        body,
        prompt,
        max_tokens,
        lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
    )
    try:
        server.scheduler.submit(job)
    except QueueFull as error:
        code = "rate_limit_exceeded"
        raise APIError(429, str(error), "requests", code=code, refused="queue_full") from None
    except NotReady as error:
        refused = "draining" if server.scheduler.draining else "not_ready"
        raise APIError(503, str(error), "server_error", code="not_ready", refused=refused) from None
    output = Output(server.tokenizer, set(job.request.stop_ids), body.stop_strings())
    request_id = protocol.new_id("chatcmpl" if kind == "chat" else "cmpl")
    if body.stream:
        chunks = stream(server, kind, body, job, events, output, request_id)
        return StreamingResponse(
            chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    watcher = asyncio.create_task(watch_disconnect(request, events))
    try:
        text, finish = "", None
        while finish is None:
            event = await events.get()
            if event is None:  # the client went away
                server.scheduler.metrics.finished.labels("abort").inc()
                return Response(status_code=499)
            delta, finish = take(server, event, output, job)
            text += delta
    finally:
        job.cancel()
        watcher.cancel()
    ids = output.token_ids if body.return_token_ids else None
    choice = protocol.completion_choice(text, finish, ids)
    if kind == "chat":
        choice = protocol.chat_choice(text, finish, ids, delta=False, first=True)
    usage = protocol.usage(len(prompt), len(output.token_ids))
    return protocol.body(kind, request_id, server.model, [choice], usage=usage)


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
    server: Server, kind, body, job: Job, events, output: Output, request_id: str
) -> AsyncIterator[str]:
    """The SSE chunks of a streamed request; closing the
    generator (the client left) cancels the request."""
    usage_field = {"usage": None} if body.include_usage else {}
    first = True
    finish = None
    failed = False
    try:
        while finish is None:
            event = await events.get()
            before = len(output.token_ids)
            try:
                delta, finish = take(server, event, output, job)
            except APIError as error:
                failed = True
                yield sse(error.body)
                break
            ids = output.token_ids[before:] if body.return_token_ids else None
            if kind == "chat":
                choice = protocol.chat_choice(delta, finish, ids, delta=True, first=first)
            else:
                choice = protocol.completion_choice(delta, finish, ids)
            first = False
            yield sse(
                protocol.body(kind, request_id, server.model, [choice], chunk=True, **usage_field)
            )
        if body.include_usage and finish is not None:
            usage = protocol.usage(len(job.request.prompt), len(output.token_ids))
            yield sse(protocol.body(kind, request_id, server.model, [], chunk=True, usage=usage))
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()
        if finish is None and not failed:  # the client left first
            server.scheduler.metrics.finished.labels("abort").inc()


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
