"""A request's rows as the scheduler's jobs, each checked against what this server runs before any
is queued, and queued all together or none; what fails is an ``APIError`` (an OpenAI error body,
and the refusal it is counted as)."""

from __future__ import annotations

import dataclasses
import secrets

from jaxdd.decoding.checks import Words, check_tokens
from jaxdd.decoding.requests import RowRequest
from jaxdd.decoding.sampling import Sampling
from jaxdd.errors import InputError, RequestRefused
from jaxdd.serve import protocol
from jaxdd.serve.scheduler import Event, Job, NotReady, QueueFull, Scheduler
from jaxdd.weights.tokenizer import TextTokenizer

# where the API and the server's flags name a field or limit otherwise than jaxdd (``Words``)
SERVER_WORDS = Words(
    max_new_tokens="max_tokens",
    stop_ids="stop_token_ids",
    max_len="the server's --max-len",
    max_prompt="--max-prompt",
    max_logprobs="--max-logprobs",
)


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
    max_tokens = body.max_new_tokens
    if max_tokens is None:  # the rest of --max-len (a prompt that fills it is refused for it)
        max_tokens = max(server.scheduler.max_len - len(prompt), 1)
    seed = secrets.randbelow(2**32) if body.seed is None else (body.seed + draw) % 2**32
    sampling = Sampling(body.temperature, body.top_p, max(body.top_k, 0), seed)
    if max_tokens == 0 and not asked.echo:
        message = "max_tokens: 0 is served only with echo (the prompt alone, scored with logprobs)"
        raise APIError(400, message, param="max_tokens")
    score = asked.echo and asked.logprobs is not None  # the echoed prompt's logprobs
    request = RowRequest(prompt, max_tokens, body.stop_ids(), sampling, asked.logprobs, score)
    if not computed(request):
        check_echoed(server, prompt)
        return Job(request, deliver)
    try:
        request = server.scheduler.pool.check(request, SERVER_WORDS, tuple(server.stop_ids))
    except RequestRefused as error:
        raise APIError(400, str(error), param=error.field, refused=error.reason) from None
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
