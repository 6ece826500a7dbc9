"""One request to an upstream server (the local vLLM, a prefill pod), and its answer sent to
the client as it arrives.

Bytes pass through as the upstream sent them (``aiter_raw``: a compressed body stays
compressed, with its headers), so that an SSE stream reaches the client event by event.
Hop-by-hop headers (RFC 9110, 7.6.1) are not forwarded either way, nor the client's
``Host`` (httpx names the upstream), nor the upstream's ``Date`` and ``Server`` (uvicorn
writes its own).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable

import httpx
from starlette.types import Send

Headers = list[tuple[bytes, bytes]]

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
_NOT_FORWARDED = HOP_BY_HOP | {b"host", b"expect"}
_NOT_RETURNED = HOP_BY_HOP | {b"date", b"server"}


def forwarded(headers: Iterable[tuple[bytes, bytes]], dropped: Collection[bytes] = ()) -> Headers:
    """The client's request headers (ASGI's, lower case) an upstream is sent, less
    ``dropped``."""
    return [
        (name, value)
        for name, value in headers
        if name not in _NOT_FORWARDED and name not in dropped
    ]


def returned(response: httpx.Response, extra: Headers) -> Headers:
    """An upstream's response headers as the client gets them, and ``extra``."""
    kept = [
        (name.lower(), value)
        for name, value in response.headers.raw
        if name.lower() not in _NOT_RETURNED
    ]
    return kept + extra


async def relay(
    client: httpx.AsyncClient, request: httpx.Request, send: Send, extra: Headers
) -> None:
    """Send ``request`` and stream its answer to the client, with ``extra`` headers; an
    upstream that cannot be reached is a 502. Cancelled (the client left), the upstream's
    connection is closed, which aborts the request there."""
    try:
        response = await client.send(request, stream=True)
    except httpx.HTTPError as error:
        await error_response(send, 502, f"{request.url.host}:{request.url.port}: {error!r}", extra)
        return
    try:
        await send(
            {
                "type": "http.response.start",
                "status": response.status_code,
                "headers": returned(response, extra),
            }
        )
        async for chunk in response.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    finally:
        await response.aclose()


async def whole_response(send: Send, status: int, headers: Headers, body: bytes) -> None:
    """A response whose body is all at hand."""
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def error_response(send: Send, status: int, detail: str, extra: Headers) -> None:
    """The sidecar's own error: one line of JSON, ``{"detail": ...}``, as the project's other
    servers answer."""
    body = json.dumps({"detail": detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *extra,
    ]
    await whole_response(send, status, headers, body)
