"""An ASGI middleware that decides about a request body before anyone reads it.

FastAPI reads and parses a whole body before a route's dependencies check the token,
so without this gate any client that reaches the port makes the process hold (and
parse) as many bytes as it cares to send. For a request that carries a body (a
``Content-Length`` above 0, or ``Transfer-Encoding``), in this order:

1. a declared ``Content-Length`` above ``max_body_bytes``: 413, body unread;
2. no token the API accepts: 401 or 403 (:class:`kvpool.common.web.common.BearerAuth`),
   body unread (an API without tokens, the admission webhook, gives no ``auth``);

and the connection is closed after the answer, so that the body it announced is not
read either (the server would otherwise drain it, at whatever rate the client sends, until
the head timeout: 13 GiB in 10 s over loopback);
3. while the app reads: more bytes than ``max_body_bytes`` (a chunked or short-declared
   body) is 413, and a body not complete ``body_timeout_seconds`` after the head is 408
   and the connection is closed (after a 413 too). The app then sees a disconnect and
   its answer is dropped.

Requests without a body pass untouched (the routes' own dependencies authenticate them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Protocol

from starlette import status
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpool.common.config import HttpLimits

_DISCONNECT: Message = {"type": "http.disconnect"}


class Authenticator(Protocol):
    """Who sends a request, or HTTPException: :class:`kvpool.common.web.common.BearerAuth`
    (not imported: the operator's webhook uses the gate without FastAPI)."""

    def caller(self, scope: Scope) -> object: ...


class BodyGate:
    def __init__(self, app: ASGIApp, *, auth: Authenticator | None, limits: HttpLimits) -> None:
        self.app = app
        self._auth = auth
        self.max_bytes = int(limits.max_body_bytes)
        self.timeout_seconds = limits.body_timeout_seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name: value for name, value in scope["headers"]}
        declared = _declared_length(headers.get(b"content-length"))
        if declared is None:
            await _error(status.HTTP_400_BAD_REQUEST, "malformed Content-Length", _CLOSE)(
                scope, receive, send
            )
            return
        if not declared and b"transfer-encoding" not in headers:
            await self.app(scope, receive, send)
            return
        if declared > self.max_bytes:
            await self._too_large()(scope, receive, send)
            return
        try:
            if self._auth is not None:
                self._auth.caller(scope)
        except HTTPException as refusal:
            closing = {**(refusal.headers or {}), **_CLOSE}
            await _error(refusal.status_code, refusal.detail, closing)(scope, receive, send)
            return
        await _MeteredRequest(self, scope, receive, send).run()

    def _too_large(self) -> JSONResponse:
        return _error(
            status.HTTP_413_CONTENT_TOO_LARGE,
            f"request body larger than {self.max_bytes} bytes",
            _CLOSE,
        )


class _MeteredRequest:
    """One request whose body is counted and timed as the app reads it."""

    def __init__(self, gate: BodyGate, scope: Scope, receive: Receive, send: Send) -> None:
        self._gate = gate
        self._scope = scope
        self._receive = receive
        self._send = send
        self._deadline = asyncio.get_running_loop().time() + gate.timeout_seconds
        self._received = 0
        self._complete = False
        self._responded = False
        self._aborted = False

    async def run(self) -> None:
        await self._gate.app(self._scope, self.receive, self.send)

    async def receive(self) -> Message:
        if self._aborted:
            return _DISCONNECT
        if self._complete:  # what follows the body: only a disconnect
            return await self._receive()
        try:
            async with asyncio.timeout_at(self._deadline):
                message = await self._receive()
        except TimeoutError:
            reason = f"request body not received within {self._gate.timeout_seconds:g} s"
            return await self._abort(_error(status.HTTP_408_REQUEST_TIMEOUT, reason, _CLOSE))
        if message["type"] == "http.request":
            self._received += len(message.get("body", b""))
            if self._received > self._gate.max_bytes:
                return await self._abort(self._gate._too_large())
            self._complete = not message.get("more_body", False)
        return message

    async def send(self, message: Message) -> None:
        if self._aborted:
            return
        self._responded = True
        await self._send(message)

    async def _abort(self, response: JSONResponse) -> Message:
        """Answer ``response`` (unless the app has begun answering) and end the request."""
        self._aborted = True
        if not self._responded:
            await response(self._scope, self._receive, self._send)
        return _DISCONNECT


_CLOSE = {"Connection": "close"}


def _declared_length(value: bytes | None) -> int | None:
    """The Content-Length (0 if absent), or None if it is not a plain decimal count."""
    if value is None:
        return 0
    return int(value) if value.isdigit() else None


def _error(code: int, detail: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=code, headers=headers)
