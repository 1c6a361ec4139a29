"""The HTTP side: FastAPI routes for the OpenAI endpoints, SSE streams, OpenAI error bodies.

Every request is checked before it is queued (a 400 names the field); past ``--max-waiting`` it
gets a 429. Logprobs (up to ``--max-logprobs`` top ones) and a completion's ``echo`` are shaped by
``jaxdd.serve.logprobs``; ``echo`` with ``max_tokens`` 0 scores the prompt alone, or without
logprobs is answered by the HTTP side alone. A request is one row per prompt of a batch and per
sample (``n``), all queued together (or none), each its own choice. A stream whose client goes
away cancels its rows (the generator is closed), and so does a non-streaming request whose client
disconnects (polled while it waits). Each refusal and each row's end (``take``, the client
leaving: "abort", a sibling's error) is counted in the metrics; usage counts cached prompt tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from jaxdd.decoding.checks import MAX_STOP_TOKENS, check_tokens
from jaxdd.decoding.requests import RowRequest
from jaxdd.decoding.sampling import Sampling
from jaxdd.errors import InputError
from jaxdd.serve import errors, protocol
from jaxdd.serve.access import AccessLog, RequireKey
from jaxdd.serve.logprobs import ChoiceLogprobs
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
    api_key: str | None = None  # without it every route is open
    access_log: bool = False


@dataclasses.dataclass(frozen=True)
class Asked:
    """What a request asks of its choices beyond their text: each token's logprob and
    ``logprobs`` top ones (None: no logprobs); ``echo``: the prompt first (a completion's)."""

    logprobs: int | None = None
    echo: bool = False


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
        self.status = status
        self.body = protocol.error_body(message, kind, param, code)
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


def check_logprobs(server: Server, asked: int | None, param: str) -> int | None:
    """The top logprobs a request asks for, within ``--max-logprobs`` (else a 400 naming
    ``param``)."""
    most = server.scheduler.max_logprobs
    if asked is None:
        return None
    if most == 0:
        raise APIError(
            400, f"{param}: this server gives no logprobs (--max-logprobs 0)", param=param
        )
    if asked > most:
        raise APIError(400, f"{param}: at most --max-logprobs {most}, got {asked}", param=param)
    return asked


def echo_text(server: Server, prompt: str | list[int]) -> str:
    """A prompt as it is echoed: its text, a prompt of ids decoded ("" without a tokenizer, as
    its outputs are)."""
    if isinstance(prompt, str):
        return prompt
    return "" if server.tokenizer is None else server.tokenizer.decode(prompt)


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
    deliver,
    draw: int = 0,
    asked: Asked = Asked(),
):
    """The job of one of a request's rows (its ``draw``-th sample of the prompt: seed + draw),
    checked against what the server runs (APIError 400 / 404 otherwise)."""
    max_tokens = body.max_new_tokens
    if body.model is not None and body.model != server.model:
        raise APIError(
            404,
            f"model {body.model!r} does not exist; this server has {server.model!r}",
            param="model",
            code="model_not_found",
        )
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
        own = len(set(server.stop_ids))
        added = len(set(body.stop_ids()) - set(server.stop_ids))
        message = f"at most {MAX_STOP_TOKENS - own} beside this model's {own} own, got {added}"
        raise APIError(400, f"stop_token_ids: {message}", param="stop_token_ids")
    seed = secrets.randbelow(2**32) if body.seed is None else (body.seed + draw) % 2**32
    sampling = Sampling(body.temperature, body.top_p, max(body.top_k, 0), seed)
    if max_tokens == 0 and not asked.echo:
        message = "max_tokens: 0 is served only with echo (the prompt alone, scored with logprobs)"
        raise APIError(400, message, param="max_tokens")
    score = asked.echo and asked.logprobs is not None  # the echoed prompt's logprobs
    request = RowRequest(prompt, max_tokens, stop_ids, sampling, asked.logprobs, score)
    if not computed(request):
        check_echoed(server, prompt)
        return Job(request, deliver)
    try:
        request = server.scheduler.check(request)
    except InputError as error:
        refused = "too_long" if server.scheduler.too_long(prompt, max_tokens) else "invalid"
        param = API_PARAMS.get(error.field, error.field)
        raise APIError(400, str(error), param=param, refused=refused) from None
    timeouts = [t for t in (body.timeout, server.request_timeout) if t is not None]
    return Job(request, deliver, timeout=min(timeouts) if timeouts else None)


def computed(request: RowRequest) -> bool:
    """Whether the rows have anything to compute for ``request`` (else its answer is its echoed
    prompt alone)."""
    return request.max_new_tokens > 0 or request.score_prompt


def check_echoed(server: Server, prompt: list[int]) -> None:
    """A prompt answered without the rows: its ids in the model's vocabulary, its length within
    ``--max-len`` (APIError 400 otherwise)."""
    try:
        check_tokens([prompt], server.scheduler.vocab_size)
    except InputError as error:
        raise APIError(400, str(error), param="prompt") from None
    limit = server.scheduler.max_len
    if len(prompt) > limit:
        message = f"prompt: {len(prompt)} tokens, more than --max-len {limit}"
        raise APIError(400, message, param="prompt", refused="too_long")


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


def submit(server: Server, jobs: list[Job]) -> None:
    """Queue every row of a request, or none (its rows already queued are cancelled); a request
    with nothing to compute (its echo alone) is answered at once, if the server admits any."""
    try:
        if not computed(jobs[0].request):  # alike in each row of a request
            server.scheduler.accepting()
            for job in jobs:
                job.deliver(Event([], finish="length"))
            return
        for job in jobs:
            server.scheduler.submit(job)
    except QueueFull as error:
        for job in jobs:
            job.cancel()
        code = "rate_limit_exceeded"
        raise APIError(429, str(error), "requests", code=code, refused="queue_full") from None
    except NotReady as error:
        for job in jobs:
            job.cancel()
        refused = "draining" if server.scheduler.draining else "not_ready"
        raise APIError(503, str(error), "server_error", code="not_ready", refused=refused) from None


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
            self.prompt_tokens, self.completion_tokens, sum(j.cached for j in self.jobs)
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
