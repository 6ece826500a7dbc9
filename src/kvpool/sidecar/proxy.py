"""The sidecar's ASGI app: the local vLLM's proxy, which disaggregates the requests the picker
chose to.

A ``POST /v1/completions`` or ``/v1/chat/completions`` naming a prefill pod the sidecar may
follow (:func:`~kvpool.sidecar.prefill.prefill_target`) is served in two steps: the prefill
there, then the decode here with what the prefill answered, or, when the prefill fails, the
client's own request here (the local vLLM computes the prompt: slower, never wrong). Every
other request, and one whose body is not a JSON object (vLLM answers it), is proxied
unchanged, streamed both ways, without the prefill headers. Responses of the two
disaggregable paths carry :data:`~kvpool.common.disagg.RESULT_HEADER`:
``prefill=<address>; status=<status>; prefill_ms=<n>``, the status one of ``ok``,
``fallback``, ``refused`` (the prefill pod's 4xx, returned as is) and ``passthrough``
(served here alone; without ``prefill=`` when no prefill pod was named).

A client that disconnects cancels what its request waits for, the prefill or the decode:
closing the upstream connection aborts the request in that vLLM, so a client that gives up
frees the GPUs it was using.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

import httpx
from starlette.datastructures import Headers as HeaderMap
from starlette.types import Message, Receive, Scope, Send

from kvpool.common.disagg import PREFILL_HEADER, RESULT_HEADER, PrefillTarget
from kvpool.common.web.rate_limited_log import RateLimitedLog
from kvpool.sidecar.bodies import Prefilled, decode_body, prefill_body
from kvpool.sidecar.prefill import LLMD_HEADER, Fallback, Refused, prefill, prefill_target
from kvpool.sidecar.relay import Headers, forwarded, relay, whole_response
from kvpool.sidecar.settings import SidecarSettings

log = logging.getLogger(__name__)

DISAGGREGABLE = frozenset({"/v1/completions", "/v1/chat/completions"})
_PREFILL_HEADERS = frozenset({PREFILL_HEADER.encode(), LLMD_HEADER.encode()})
_REWRITTEN = _PREFILL_HEADERS | {b"content-length"}
"""Not sent with a body the sidecar wrote (httpx sets its length)."""
_TO_PREFILL = _REWRITTEN | {b"content-type", b"accept-encoding", b"accept"}


class ClientGone(Exception):
    """The client disconnected while its request body was being read."""


class Sidecar:
    def __init__(
        self,
        settings: SidecarSettings,
        client: httpx.AsyncClient,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._settings = settings
        self._client = client
        self._clock = clock
        self._flood_log = RateLimitedLog(log)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        exchange = _Exchange(scope, receive, send)
        handler = asyncio.create_task(self._serve(scope, exchange))
        watcher = asyncio.create_task(exchange.client_left())
        try:
            await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not exchange.answered:
                handler.cancel()
            await asyncio.wait({handler, watcher})
        if not handler.cancelled():
            handler.result()  # an error of the handler's is uvicorn's to log

    async def _serve(self, scope: Scope, exchange: _Exchange) -> None:
        with contextlib.suppress(ClientGone):  # nobody is left to answer
            await self._route(scope, exchange)

    async def _route(self, scope: Scope, exchange: _Exchange) -> None:
        url = self._vllm_url(scope)
        headers = forwarded(scope["headers"], _PREFILL_HEADERS)
        disaggregable = scope["method"] == "POST" and scope["path"] in DISAGGREGABLE
        target = None
        if disaggregable:
            target = prefill_target(
                HeaderMap(scope=scope), self._settings, self._clock(), self._flood_log
            )
        if target is None:
            extra = _result(None, "passthrough") if disaggregable else []
            content = exchange.body() if exchange.has_body else None
            request = self._client.build_request(
                scope["method"], url, headers=headers, content=content
            )
            await relay(self._client, request, exchange.send, extra)
            return
        raw = await exchange.read_body()
        try:
            original = json.loads(raw)
        except ValueError:
            original = None
        if not isinstance(original, dict):  # vLLM's 400 tells the client why
            request = self._client.build_request("POST", url, headers=headers, content=raw)
            await relay(self._client, request, exchange.send, _result(target, "passthrough"))
            return
        await self._disaggregate(scope, exchange, target, original, raw)

    async def _disaggregate(
        self,
        scope: Scope,
        exchange: _Exchange,
        target: PrefillTarget,
        original: dict[str, object],
        raw: bytes,
    ) -> None:
        settings = self._settings
        started = time.monotonic()
        outcome = await prefill(
            self._client,
            target,
            _raw_target(scope).decode("latin-1"),
            forwarded(scope["headers"], _TO_PREFILL),
            prefill_body(original, settings.node),
            timeout_s=settings.prefill_timeout_s,
            chat=scope["path"].endswith("/chat/completions"),
        )
        took_ms = round((time.monotonic() - started) * 1000)
        if isinstance(outcome, Refused):
            extra = _result(target, "refused", took_ms)
            await whole_response(
                exchange.send, outcome.status, outcome.headers + extra, outcome.body
            )
            return
        if isinstance(outcome, Fallback):
            self._flood_log.warning(
                f"prefill on {target.address} failed, the prompt is computed here: {outcome.reason}"
            )
            content, status = raw, "fallback"
        else:
            content, status = _decode_content(original, outcome, target, settings), "ok"
        headers = forwarded(scope["headers"], _REWRITTEN)
        url = self._vllm_url(scope)
        request = self._client.build_request("POST", url, headers=headers, content=content)
        await relay(self._client, request, exchange.send, _result(target, status, took_ms))

    def _vllm_url(self, scope: Scope) -> httpx.URL:
        return httpx.URL(self._settings.vllm).copy_with(raw_path=_raw_target(scope))


def _decode_content(
    original: dict[str, object],
    prefilled: Prefilled,
    target: PrefillTarget,
    settings: SidecarSettings,
) -> bytes:
    body = decode_body(original, prefilled, node=target.node, wait_ms=settings.decode_wait_ms)
    return json.dumps(body).encode()


def _raw_target(scope: Scope) -> bytes:
    """The request's path and query as the client sent them."""
    path: bytes = scope.get("raw_path") or scope["path"].encode()
    query: bytes = scope.get("query_string", b"")
    return path + b"?" + query if query else path


def _result(target: PrefillTarget | None, status: str, took_ms: int | None = None) -> Headers:
    parts = [] if target is None else [f"prefill={target.address}"]
    parts.append(f"status={status}")
    if took_ms is not None:
        parts.append(f"prefill_ms={took_ms}")
    return [(RESULT_HEADER.encode(), "; ".join(parts).encode())]


class _Exchange:
    """One request's client side: its body, read once, and whether the client is still
    there once it is read."""

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = HeaderMap(scope=scope)
        self.has_body = headers.get("content-length", "0") != "0" or "transfer-encoding" in headers
        self._receive = receive
        self._send = send
        self._read = asyncio.Event()
        if not self.has_body:
            self._read.set()
        self.answered = False
        """The response's last bytes are sent: nothing is left to cancel."""

    async def send(self, message: Message) -> None:
        await self._send(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.answered = True

    async def body(self) -> AsyncIterator[bytes]:
        """The request body as it arrives; :class:`ClientGone` if the client leaves first."""
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            yield message.get("body", b"")
            if not message.get("more_body", False):
                self._read.set()
                return

    async def read_body(self) -> bytes:
        return b"".join([chunk async for chunk in self.body()])

    async def client_left(self) -> None:
        """Return when the client disconnects after its body was read (uvicorn's receive
        says so, or says the response is complete, which the caller tells apart)."""
        await self._read.wait()
        while (await self._receive())["type"] != "http.disconnect":
            pass
