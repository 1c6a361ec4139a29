"""The OpenAI wire format: request models (pydantic, OpenAI's field names, vLLM's ``top_k``,
``stop_token_ids`` and ``return_token_ids``), response and chunk bodies, and error bodies."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict

from jaxdd.decoding.checks import MAX_STOP_TOKENS

# strict: true / 1.0 / "1" are not token ids
TokenId = Annotated[int, Strict(), Field(ge=0, lt=2**31)]
# A stop string is a few words; holding back text that
# could begin one costs its length squared per event.
StopString = Annotated[str, Field(max_length=256)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What both endpoints take besides the prompt. Unknown
    fields are ignored, as OpenAI's server does."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    # OpenAI's default and range; 0 is greedy
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, lt=2**31)  # 0 or -1 (vLLM's spelling): no limit
    seed: int | None = Field(None, ge=0, lt=2**32)
    n: Literal[1] = 1
    stop: (
        StopString | Annotated[list[StopString | TokenId], Field(max_length=MAX_STOP_TOKENS)] | None
    ) = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKENS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    # seconds this request may run; the server's --request-timeout caps it
    timeout: float | None = Field(None, gt=0.0)

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stops if isinstance(s, str) and s]

    def stop_ids(self) -> list[int]:
        stops = [] if isinstance(self.stop, str) or self.stop is None else self.stop
        return [s for s in stops if isinstance(s, int)] + list(self.stop_token_ids or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]


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
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    total = prompt_tokens + completion_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": total,
    }


def completion_choice(text: str, finish: str | None, token_ids: list[int] | None) -> dict:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_choice(
    text: str, finish: str | None, token_ids: list[int] | None, *, delta: bool, first: bool
) -> dict:
    message: dict[str, Any] = {"content": text} if text or not delta else {}
    if first or not delta:
        message["role"] = "assistant"
    choice: dict[str, Any] = {
        "index": 0,
        "delta" if delta else "message": message,
        "finish_reason": finish,
    }
    if not delta:
        choice["logprobs"] = None
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
