"""The OpenAI wire format: request models (pydantic, OpenAI's field names, vLLM's ``top_k``,
``stop_token_ids`` and ``return_token_ids``), response and chunk bodies, and error bodies.

Every field of OpenAI's two request bodies is declared: it works, or it is ``unsupported`` (a value
other than its default is refused by name, so a client never believes it got what it did not).
An explicit ``null`` means the field's default. Fields OpenAI does not know are ignored, as its
server ignores them, except vLLM's that change the output (refused like OpenAI's).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, model_validator
from pydantic_core import PydanticCustomError

from jaxdd.decoding.checks import MAX_STOP_TOKENS

# strict: true / 1.0 / "1" are not token ids
TokenId = Annotated[int, Strict(), Field(ge=0, lt=2**31)]
# A stop string is a few words; holding back text that
# could begin one costs its length squared per event.
StopString = Annotated[str, Field(max_length=256)]


def unsupported(*defaults: Any) -> Any:
    """A field jaxdd does not implement: absent, null or one of ``defaults`` (the values that
    leave the output as if it were absent) passes; any other value is refused by name."""

    def check(value: Any) -> Any:
        if value is not None and not any(value == d and type(value) is type(d) for d in defaults):
            allowed = " or ".join(["null", *(repr(d) for d in defaults)])
            raise PydanticCustomError(
                "not_implemented",
                "jaxdd does not implement it; send {allowed} or leave it out",
                {"allowed": allowed},
            )
        return value

    return Annotated[Any, AfterValidator(check), Field(default=None)]


class Fields(BaseModel):
    """A request body: unknown fields ignored, and an explicit null taken as the field's default
    (a required field's null stays, to be refused)."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            key: value
            for key, value in data.items()
            if value is not None or key not in fields or fields[key].is_required()
        }


class StreamOptions(Fields):
    include_usage: bool = False
    # OpenAI's padding against length side channels: the chunks' content is the same without it
    include_obfuscation: bool = True


class SamplingFields(Fields):
    """What both endpoints take besides the prompt."""

    model: str | None = None
    # 0: no new token, only with a completion's echo (the prompt alone)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)  # OpenAI's newer name for max_tokens
    # OpenAI's default and range; 0 is greedy
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, lt=2**31)  # 0 or -1 (vLLM's spelling): no limit
    seed: int | None = Field(None, ge=0, lt=2**32)
    n: int = Field(1, ge=1)  # independent rows of each prompt; the server's --max-batch caps it
    stop: (
        StopString | Annotated[list[StopString | TokenId], Field(max_length=MAX_STOP_TOKENS)] | None
    ) = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKENS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    # seconds this request may run; the server's --request-timeout caps it
    timeout: float | None = Field(None, gt=0.0)
    user: str | None = None  # a tag for the caller's own records: it changes no output
    frequency_penalty: unsupported(0, 0.0)
    presence_penalty: unsupported(0, 0.0)
    logit_bias: unsupported({})
    # vLLM's fields that would change the output
    min_tokens: unsupported(0)
    ignore_eos: unsupported(False)
    repetition_penalty: unsupported(1, 1.0)
    min_p: unsupported(0, 0.0)
    use_beam_search: unsupported(False)
    length_penalty: unsupported(1, 1.0)
    include_stop_str_in_output: unsupported(False)
    prompt_logprobs: unsupported()
    truncate_prompt_tokens: unsupported()
    bad_words: unsupported([])
    allowed_token_ids: unsupported()
    logits_processors: unsupported()
    structured_outputs: unsupported()
    guided_json: unsupported()
    guided_regex: unsupported()
    guided_choice: unsupported()
    guided_grammar: unsupported()

    @property
    def max_new_tokens(self) -> int | None:
        """The output limit asked for, under either of OpenAI's names (None: as many as fit)."""
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stops if isinstance(s, str) and s]

    def stop_ids(self) -> list[int]:
        stops = [] if isinstance(self.stop, str) or self.stop is None else self.stop
        return [s for s in stops if isinstance(s, int)] + list(self.stop_token_ids or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


Text = Annotated[str, Field(min_length=1)]
Ids = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    # OpenAI's four forms: a text, its ids, a batch of texts or of id lists (lm-eval's default)
    prompt: Text | Ids | Annotated[list[Text] | list[Ids], Field(min_length=1)]
    best_of: int | None = Field(None, ge=1)  # the n best of best_of: only best_of == n is served
    # each token's logprob and this many top ones (the server's --max-logprobs caps it)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False  # the prompt's text first (with logprobs, its tokens' logprobs too)
    suffix: unsupported("")

    def prompts(self) -> list[str | list[int]]:
        """The batch's prompts, one for a single prompt."""
        single = isinstance(self.prompt, str) or isinstance(self.prompt[0], int)
        return [self.prompt] if single else list(self.prompt)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return (
            self.content
            if isinstance(self.content, str)
            else "".join(part.text for part in self.content)
        )


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    # tags, routing and retention hints for OpenAI's own service: they change no output
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    logprobs: bool = False  # each token's logprob
    top_logprobs: int | None = Field(None, ge=0)  # and this many top ones, with logprobs
    audio: unsupported()
    modalities: unsupported(["text"])
    function_call: unsupported("none")
    functions: unsupported([])
    tools: unsupported([])
    tool_choice: unsupported("none")
    parallel_tool_calls: unsupported(True)
    prediction: unsupported()
    reasoning_effort: unsupported()
    response_format: unsupported({"type": "text"})
    store: unsupported(False)
    moderation: unsupported()
    verbosity: unsupported()
    web_search_options: unsupported()
    # vLLM's chat fields that would change the prompt or the output
    echo: unsupported(False)
    add_generation_prompt: unsupported(True)
    continue_final_message: unsupported(False)
    chat_template: unsupported()
    chat_template_kwargs: unsupported({})


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage, ``cached_tokens`` the prompt tokens found in the prefix cache."""
    total = prompt_tokens + completion_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": total,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_choice(
    text: str,
    finish: str | None,
    token_ids: list[int] | None,
    index: int,
    logprobs: dict | None = None,
) -> dict:
    choice: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_choice(
    text: str,
    finish: str | None,
    token_ids: list[int] | None,
    index: int,
    *,
    delta: bool,
    first: bool,
    logprobs: dict | None = None,
) -> dict:
    message: dict[str, Any] = {"content": text} if text or not delta else {}
    if first or not delta:
        message["role"] = "assistant"
    choice: dict[str, Any] = {
        "index": index,
        "delta" if delta else "message": message,
        "finish_reason": finish,
    }
    if not delta or logprobs is not None:
        choice["logprobs"] = logprobs
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def body(
    kind: Literal["completion", "chat"], request_id: str, model: str, choices: list[dict], **extra
) -> dict:
    """A response (``chunk=False``) or stream chunk body."""
    chunk = extra.pop("chunk", False)
    objects = {
        ("completion", False): "text_completion",
        ("completion", True): "text_completion",
        ("chat", False): "chat.completion",
        ("chat", True): "chat.completion.chunk",
    }
    return {
        "id": request_id,
        "object": objects[kind, chunk],
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        **extra,
    }


def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code=None
) -> dict:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
