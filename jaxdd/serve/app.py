"""The HTTP side: FastAPI routes for the OpenAI endpoints, SSE streams, OpenAI error bodies.

Every request is checked before it is queued (a 400 names the field); past ``--max-waiting`` it
gets a 429. Logprobs (up to ``--max-logprobs`` top ones) and a completion's ``echo`` are shaped by
``jaxdd.serve.logprobs``; ``echo`` with ``max_tokens`` 0 scores the prompt alone, or without
logprobs is answered by the HTTP side alone. A request is one row per prompt of a batch and per
sample (``n``), all queued together (or none), each its own choice. A stream whose client goes
away cancels its rows (the generator is closed), and so does a non-streaming request whose client
disconnects (polled while it waits). Each refusal and each row's end (``take``, the client
leaving: "abort", a sibling's error) is counted in the metrics; usage counts cached prompt tokens.
The rows' checks and queueing are ``jaxdd.serve.jobs``; their answers, ``jaxdd.serve.choices``.
"""

from __future__ import annotations

import asyncio
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from jaxdd.errors import InputError
from jaxdd.serve import errors, protocol
from jaxdd.serve.access import AccessLog, RequireKey
from jaxdd.serve.choices import Choices, stream, watch_disconnect
from jaxdd.serve.jobs import (
    APIError,
    Asked,
    Server,
    check_logprobs,
    echo_text,
    encode,
    make_job,
    submit,
)
from jaxdd.weights.tokenizer import render_chat_template


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
        prompts = [
            encode(server, p, special=False) if isinstance(p, str) else list(p)
            for p in body.prompts()
        ]
        if body.best_of not in (None, body.n):
            message = f"best_of: only best_of == n ({body.n}) is served, got {body.best_of}"
            raise APIError(400, message, param="best_of")
        asked = Asked(check_logprobs(server, body.logprobs, "logprobs"), body.echo)
        return await generate(server, "completion", body, prompts, request, asked)

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
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs true", param="top_logprobs")
        top = (body.top_logprobs or 0) if body.logprobs else None
        param = "logprobs" if body.top_logprobs is None else "top_logprobs"
        asked = Asked(check_logprobs(server, top, param))
        return await generate(server, "chat", body, [prompt], request, asked)

    def refuse(reason: str) -> None:
        server.scheduler.metrics.refused.labels(reason).inc()

    errors.install(app, refuse)
    if server.api_key is not None:  # outside the body guard: a stranger's body is not read
        app.add_middleware(RequireKey, key=server.api_key, refuse=refuse)
    if server.access_log:  # outermost: every answer is logged, refusals included
        app.add_middleware(AccessLog)
    return app


async def generate(
    server: Server,
    kind: Literal["completion", "chat"],
    body,
    prompts: list[list[int]],
    request: Request,
    asked: Asked,
):
    """Answer a request: each prompt's ``n`` rows, submitted together, each its own choice (index
    prompt * n + draw), streamed or whole; with ``asked.echo`` (a completion's), each prompt's
    text first."""
    loop = asyncio.get_running_loop()
    events = asyncio.Queue()
    rows = len(prompts) * body.n
    most = server.scheduler.rows
    limit = most + server.scheduler.max_waiting
    if body.n > most:
        message = f"n: at most --max-batch {most} rows decode at once, got {body.n}"
        raise APIError(400, message, param="n")
    if rows > limit:
        message = (
            f"prompt: {len(prompts)} prompts x n {body.n} = {rows} rows, more than this server "
            f"holds ({limit}: --max-batch + --max-waiting)"
        )
        raise APIError(400, message, param="prompt")

    def deliver(index: int):
        return lambda event: loop.call_soon_threadsafe(events.put_nowait, (index, event))

    jobs = [
        make_job(server, body, prompt, deliver(p * body.n + i), i, asked)
        for p, prompt in enumerate(prompts)
        for i in range(body.n)
    ]
    prompt_tokens = sum(map(len, prompts))
    choices = Choices(server, kind, jobs, body.stop_strings(), prompt_tokens, request.state, asked)
    if asked.echo:  # spelled once its ids are checked
        choices.echo([echo_text(server, p) for p in body.prompts() for _ in range(body.n)])
    submit(server, jobs)
    request_id = protocol.new_id("chatcmpl" if kind == "chat" else "cmpl")
    if body.stream:
        chunks = stream(server, kind, body, choices, events, request_id)
        return StreamingResponse(
            chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    watcher = asyncio.create_task(watch_disconnect(request, events))
    texts = [""] * len(jobs)
    parts: list[list[dict]] = [[] for _ in jobs]  # each choice's logprobs, as they come
    try:
        while not choices.done:
            item = await events.get()
            if item is None:  # the client went away
                choices.end("abort")
                return Response(status_code=499)
            index, event = item
            text, logprobs = choices.take(index, event)
            texts[index] += text
            if logprobs is not None:
                parts[index].append(logprobs)
    finally:
        choices.end("error")  # rows left when a sibling's error ended the request
        watcher.cancel()
    out = []
    for index, (text, output) in enumerate(zip(texts, choices.outputs, strict=True)):
        ids = output.token_ids if body.return_token_ids else None
        finish = choices.finishes[index]
        choice_logprobs = choices.logprobs[index]
        logprobs = None if choice_logprobs is None else choice_logprobs.joined(parts[index])
        if kind == "chat":
            choice = protocol.chat_choice(
                text, finish, ids, index, delta=False, first=True, logprobs=logprobs
            )
        else:
            choice = protocol.completion_choice(text, finish, ids, index, logprobs)
        out.append(choice)
    return protocol.body(kind, request_id, server.model, out, usage=choices.usage())
