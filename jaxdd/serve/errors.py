"""OpenAI error bodies for everything a careless or
hostile client can send, before anything is queued.

``install(app)`` adds an ASGI guard (413 past ``MAX_BODY_BYTES``, counted as the body arrives,
chunked bodies included; 415 for a body that is not JSON by its content type) and exception
handlers that name what is wrong: malformed JSON, an empty body, a union field's right branch (a
token-id list's bad element, not "should be a string"), and a 500 body for a failure no handler
expected. Each refusal is counted through ``refuse`` (its reason: ``metrics.REFUSALS``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxdd.serve.protocol import error_body

# far above any prompt the context admits, far below what would tie up the event loop
MAX_BODY_BYTES = 1 << 20
LOG = logging.getLogger("jaxdd.serve")


def error_json(
    status: int, message: str, kind: str = "invalid_request_error", param=None, code=None
) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


class BodyGuard:
    """ASGI middleware: refuse oversized and non-JSON
    bodies of POST requests before the route reads them."""

    def __init__(self, app: ASGIApp, refuse: Callable[[str], None], max_bytes=MAX_BODY_BYTES):
        self.app = app
        self.refuse = refuse
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        headers = {key.lower(): value for key, value in scope["headers"]}
        kind = (
            headers.get(b"content-type", b"application/json")
            .split(b";")[0]
            .strip()
            .decode("latin-1")
            .lower()
        )
        if kind != "application/json" and not kind.endswith("+json"):
            message = f"Content-Type must be application/json, got {kind or 'none'!r}"
            self.refuse("invalid")
            return await error_json(415, message, code="unsupported_media_type")(
                scope, receive, send
            )
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self.too_large(int(length))(scope, receive, send)
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b"")) if message["type"] == "http.request" else 0
            # FastAPI re-raises an HTTPException from reading the body: a 413 body
            if seen > self.max_bytes:
                raise HTTPException(413, self.too_large_message(seen))
            return message

        await self.app(scope, counted, send)

    def too_large(self, size: int) -> JSONResponse:
        self.refuse("too_long")
        return error_json(413, self.too_large_message(size), code="request_too_large")

    def too_large_message(self, size: int) -> str:
        return f"the body has {size} bytes or more; this server takes at most {self.max_bytes}"


def field_of(location: tuple) -> str:
    """``prompt.1`` from pydantic's ``("body", "prompt",
    "list[constrained-int]", 1)``: union branch tags dropped."""
    parts = [str(part) for part in location if part != "body"]
    return ".".join(part for part in parts if part.replace("_", "").isalnum())


def describe(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for the first field that failed, from the branch of a union that matched
    its type best: the deepest error, and one that is not a type mismatch where there is one."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        where = first.get("loc", ("body", "?"))[-1]
        why = first.get("ctx", {}).get("error", "decode error")
        return f"the body is not valid JSON: {why} (at character {where})", None
    if tuple(first.get("loc", ())) == ("body",):
        if first.get("type") == "missing":
            return "the body is empty: expected a JSON object", None
        return f"the body must be a JSON object: {first.get('msg')}", None
    param = field_of(first.get("loc", ()))
    top = param.split(".")[0]
    same = [e for e in errors if field_of(e.get("loc", ())).split(".")[0] == top]
    fitting = [e for e in same if not str(e.get("type", "")).endswith("_type")]
    if not fitting:  # the value matches no branch's type: say every type it could have been
        return f"{top}: " + " or ".join(dict.fromkeys(e.get("msg", "") for e in same)), top
    best = max(fitting, key=lambda e: len(e.get("loc", ())))
    where = field_of(best.get("loc", ()))
    return f"{where}: {best.get('msg')}", top


def install(app: FastAPI, refuse: Callable[[str], None]) -> None:
    """Add the body guard and the handlers (these replace earlier ones for the same exception
    types); each refusal calls ``refuse`` with its reason."""
    app.add_middleware(BodyGuard, refuse=refuse)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, error: RequestValidationError):
        refuse("invalid")
        message, param = describe(list(error.errors()))
        return error_json(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, error: StarletteHTTPException):
        if error.status_code in (400, 413):  # a body unreadable, or too large as it came
            refuse("invalid" if error.status_code == 400 else "too_long")
        # FastAPI could not read the body at all (not UTF-8, nested too deep)
        if error.status_code == 400:
            return error_json(
                400, "the body could not be read as JSON (not UTF-8, or nested too deep)"
            )
        code = "request_too_large" if error.status_code == 413 else error.status_code
        return error_json(error.status_code, str(error.detail), code=code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        LOG.exception("unexpected error in %s %s", request.method, request.url.path)
        return error_json(500, f"internal error: {type(error).__name__}", "server_error")
