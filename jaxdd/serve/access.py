"""Who may call the server and what each call did: ASGI middleware.

``RequireKey`` (``--api-key`` / ``JAXDD_API_KEY``): a request without ``Authorization: Bearer KEY``
gets OpenAI's 401 body; ``/health`` and ``/metrics`` stay open (probes and scrapers hold no key).
``AccessLog`` (off with ``--no-access-log``): one stderr line per request once its answer is sent
(a stream's at its end): ``jaxdd: access: METHOD PATH STATUS tokens PROMPT+COMPLETION SECONDS s``;
the routes put the token counts in the request's state (``request.state.usage``).
"""

from __future__ import annotations

import secrets
import sys
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxdd.serve.errors import error_json

OPEN_PATHS = ("/health", "/metrics")


class RequireKey:
    def __init__(self, app: ASGIApp, key: str, refuse: Callable[[str], None]):
        self.app = app
        self.key = f"Bearer {key}".encode()
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if secrets.compare_digest(given, self.key):  # in constant time: no key guessed by timing
            return await self.app(scope, receive, send)
        self.refuse("unauthorized")
        message = (
            "no API key given: send Authorization: Bearer KEY" if not given else "incorrect API key"
        )
        response = error_json(401, message, code="invalid_api_key")
        return await response(scope, receive, send)


class AccessLog:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        began = time.monotonic()
        status = 500  # what the client sees when the app raises before answering

        async def sent(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            usage = scope.get("state", {}).get("usage")
            tokens = f"{usage[0]}+{usage[1]}" if usage else "-"
            seconds = time.monotonic() - began
            line = f"{scope['method']} {scope['path']} {status} tokens {tokens} {seconds:.3f} s"
            print(f"jaxdd: access: {line}", file=sys.stderr, flush=True)
