"""A small client of the index's HTTP API, for Python gateways::

    with IndexClient("http://kvpool-index-main.kvpool.svc:7403", token) as index:
        route = index.route(loads={"gpu-1": 3, "gpu-2": 0}, token_ids=ids, cache_salt=salt)
        send_to(route.node)

One keep-alive connection per client; calls from several threads take turns.
Every call has a timeout. :class:`IndexUnavailable` means the index could not
be reached or did not answer in time, :class:`IndexRequestError` that it
refused the request (``status`` and ``detail``): a gateway falls back to its
own balancing on either. A connection the server closed while idle is
reopened once, transparently.
"""

from __future__ import annotations

import dataclasses
import http.client
import threading
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import urlsplit

import msgspec

from kvpool.common.keys import ModelFingerprint

T = TypeVar("T")


class IndexUnavailable(ConnectionError):
    """The index did not answer (down, unreachable, or slower than the timeout)."""


class IndexRequestError(RuntimeError):
    """The index refused the request."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"{status}: {detail}")
        self.status = status
        self.detail = detail


class Match(msgspec.Struct, frozen=True):
    node: str
    chunks: int
    tokens: int
    last_seen: float


class Lookup(msgspec.Struct, frozen=True):
    prompt_tokens: int
    chunk_tokens: int
    matches: list[Match]


class Route(msgspec.Struct, frozen=True):
    node: str
    reason: str
    matched_tokens: int
    prompt_tokens: int
    matches: list[Match]


class _Detail(msgspec.Struct):
    detail: str = ""


class IndexClient:
    def __init__(self, url: str, token: str, *, timeout: float = 1.0) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected an http(s):// URL of the index, got {url!r}")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._headers = {
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/json",
        }
        self.timeout = timeout
        self._lock = threading.Lock()
        self._connection: http.client.HTTPConnection | None = None

    def route(
        self,
        *,
        loads: Mapping[str, float],
        token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
        fingerprint: ModelFingerprint | None = None,
        chunk_keys: Sequence[bytes] | None = None,
        chunk_tokens: int | None = None,
    ) -> Route:
        """Where to send a prompt among the candidates in ``loads`` (node → load)."""
        body = _prompt(token_ids, cache_salt, fingerprint, chunk_keys, chunk_tokens)
        body["loads"] = dict(loads)
        return self._post("/v1/route", body, Route)

    def lookup(
        self,
        *,
        token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
        fingerprint: ModelFingerprint | None = None,
        chunk_keys: Sequence[bytes] | None = None,
        chunk_tokens: int | None = None,
        nodes: Sequence[str] | None = None,
    ) -> Lookup:
        """Nodes holding a prefix of a prompt, longest first."""
        body = _prompt(token_ids, cache_salt, fingerprint, chunk_keys, chunk_tokens)
        if nodes is not None:
            body["nodes"] = list(nodes)
        return self._post("/v1/lookup", body, Lookup)

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.close()
                self._connection = None

    def __enter__(self) -> IndexClient:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _post(self, path: str, body: dict[str, Any], answer: type[T]) -> T:
        payload = msgspec.json.encode(body)
        with self._lock:
            status, data = self._exchange(path, payload)
        if status != 200:
            try:
                detail = msgspec.json.decode(data, type=_Detail).detail
            except msgspec.MsgspecError:
                detail = data[:200].decode(errors="replace")
            raise IndexRequestError(status, detail)
        try:
            return msgspec.json.decode(data, type=answer)
        except msgspec.MsgspecError as error:
            raise IndexRequestError(status, f"unexpected answer: {error}") from None

    def _exchange(self, path: str, payload: bytes) -> tuple[int, bytes]:
        reused = self._connection is not None
        try:
            return self._send(path, payload)
        except TimeoutError as error:
            self._drop()
            raise IndexUnavailable(f"the index did not answer within {self.timeout}s") from error
        except (OSError, http.client.HTTPException) as error:
            self._drop()
            if not reused:
                raise IndexUnavailable(f"cannot reach the index: {error}") from error
        try:  # the server had closed the idle connection: once more on a fresh one
            return self._send(path, payload)
        except (OSError, http.client.HTTPException) as error:
            self._drop()
            raise IndexUnavailable(f"cannot reach the index: {error}") from error

    def _send(self, path: str, payload: bytes) -> tuple[int, bytes]:
        if self._connection is None:
            kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._connection = kind(self._host, self._port, timeout=self.timeout)
        self._connection.request("POST", path, payload, self._headers)
        response = self._connection.getresponse()
        return response.status, response.read()

    def _drop(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


def _prompt(
    token_ids: Sequence[int] | None,
    cache_salt: str | None,
    fingerprint: ModelFingerprint | None,
    chunk_keys: Sequence[bytes] | None,
    chunk_tokens: int | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if token_ids is not None:
        body["token_ids"] = list(token_ids)
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if fingerprint is not None:
        body["fingerprint"] = dataclasses.asdict(fingerprint)
    if chunk_keys is not None:
        body["chunk_keys"] = [key.hex() for key in chunk_keys]
    if chunk_tokens is not None:
        body["chunk_tokens"] = chunk_tokens
    return body
