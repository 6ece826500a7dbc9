"""One HTTP request's ext_proc stream: read the request, pick, let the response through.

Envoy sends the request's headers, its body in chunks, then the response's headers and
body; in FULL_DUPLEX_STREAMED mode (the one the Gateway API Inference Extension uses)
nothing reaches the upstream or the client unless the picker sends it back. So the
headers are held until the body has been read and picked for; then the headers' answer
(the destination) goes out, followed by the body in chunks; response chunks are echoed.
In BUFFERED mode (Envoy's own buffering) the headers are answered at once and the
destination rides on the body's answer. The prefill headers
(:class:`~kvpool.index.epp.prefill.PrefillHeaders`) ride with the destination.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2

from kvpool.common.web.rate_limited_log import RateLimitedLog
from kvpool.index.epp import answers
from kvpool.index.epp.bodies import Refused, Wanted, read_body
from kvpool.index.epp.prefill import PrefillHeaders
from kvpool.index.picking import NoEndpoint, Picker, PickRequest
from kvpool.index.prompts import Prompts

log = logging.getLogger(__name__)
_rare = RateLimitedLog(log)

_BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


class Answers:
    """How many requests the edge answered, by HTTP status and reason: ``(200, "prefix")``
    for a pick (its :class:`~kvpool.index.picking.PickReason`), ``(413,
    "body_too_large")``, ``(503, "no_endpoint")``... Read by the index's metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[int, str]] = Counter()

    def count(self, status: int, reason: str) -> None:
        with self._lock:
            self._counts[(status, reason)] += 1

    def snapshot(self) -> dict[tuple[int, str], int]:
        with self._lock:
            return dict(self._counts)


class BodyBudget:
    """Bytes of request bodies all streams may hold at once: the edge's memory bound
    whatever the number of streams."""

    def __init__(self, limit: int) -> None:
        self._lock = threading.Lock()
        self._limit = limit
        self._held = 0

    def take(self, size: int) -> bool:
        with self._lock:
            if self._held + size > self._limit:
                return False
            self._held += size
            return True

    @property
    def held(self) -> int:
        """Bytes held now."""
        with self._lock:
            return self._held

    def give(self, size: int) -> None:
        with self._lock:
            self._held -= size


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int
    max_prompt_tokens: int


class Phase(enum.Enum):
    HEADERS = "headers"
    """Waiting for the request's headers."""
    BODY = "body"
    """Reading the request's body."""
    PICKED = "picked"
    """The destination is sent: the response passes through."""
    DONE = "done"
    """Answered by the edge itself, or a stream out of order: nothing more to do."""


class Stream:
    """The state of one ext_proc stream. Not thread-safe: one gRPC call drives it."""

    def __init__(
        self,
        picker: Picker,
        prompts: Prompts | None,
        limits: Limits,
        tally: Answers,
        budget: BodyBudget,
        *,
        prefill: PrefillHeaders,
    ) -> None:
        self._picker = picker
        self._prefill = prefill
        self._prompts = prompts
        self._limits = limits
        self._tally = tally
        self._budget = budget
        self.phase = Phase.HEADERS
        self._method = ""
        self._path = ""
        self._subset: frozenset[str] | None = None
        self._body = bytearray()
        self._held = 0
        self._buffered = False
        self._echo_response = True
        self._pick_header = ""

    @property
    def finished(self) -> bool:
        return self.phase is Phase.DONE

    def close(self) -> None:
        """Give back the body's bytes (called once the stream ends, however it ends)."""
        self._budget.give(self._held)
        self._held = 0
        self._body = bytearray()

    def handle(self, request: Any) -> Iterable[Any]:
        """The answers to one message of Envoy's."""
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            return self._request_headers(request)
        if kind == "request_body":
            return self._request_body(request.request_body)
        if kind == "request_trailers":
            return self._request_trailers()
        if self.phase is Phase.PICKED and kind == "response_headers":
            return [answers.pick_header(self._pick_header)]
        if self.phase is Phase.PICKED and kind == "response_body" and self._echo_response:
            body = request.response_body
            return [answers.streamed_response_body(body.body, body.end_of_stream)]
        if self.phase is Phase.PICKED and kind in (
            "response_headers",
            "response_body",
            "response_trailers",
        ):
            return [answers.carry_on(kind)]
        return self._out_of_order(str(kind))

    def _out_of_order(self, kind: str) -> Iterable[Any]:
        _rare.warning(f"an ext_proc stream sent {kind} while {self.phase.value}: ended")
        self.phase = Phase.DONE
        return []

    def _request_headers(self, request: Any) -> Iterable[Any]:
        if self.phase is not Phase.HEADERS:
            return self._out_of_order("request_headers")
        if request.HasField("protocol_config"):
            config = request.protocol_config
            mode = config.request_body_mode
            if mode not in (_FULL_DUPLEX, _BUFFERED):
                return self._refuse(
                    Refused(
                        500,
                        "unsupported_mode",
                        "the picker needs request bodies FULL_DUPLEX_STREAMED or BUFFERED",
                    )
                )
            self._buffered = mode == _BUFFERED
            self._echo_response = config.response_body_mode == _FULL_DUPLEX
        self._subset = _subset(request.metadata_context)
        for header in request.request_headers.headers.headers:
            if header.key == ":method":
                self._method = _header_text(header)
            elif header.key == ":path":
                self._path = _header_text(header)
        if request.request_headers.end_of_stream:
            return self._pick(Wanted(), routed=answers.route_headers)
        self.phase = Phase.BODY
        return [answers.carry_on("request_headers")] if self._buffered else []

    def _request_body(self, body: Any) -> Iterable[Any]:
        if self.phase is not Phase.BODY:
            return self._out_of_order("request_body")
        chunk = body.body
        if len(self._body) + len(chunk) > self._limits.max_body_bytes:
            return self._refuse(
                Refused(
                    413,
                    "body_too_large",
                    "the request body is larger than the "
                    f"picker reads ({self._limits.max_body_bytes} bytes)",
                )
            )
        if not self._budget.take(len(chunk)):
            return self._refuse(Refused(503, "busy", "the picker holds too many bodies now"))
        self._held += len(chunk)
        self._body += chunk
        if self._buffered:
            return self._pick_body(answers.route_buffered_body, send_body=False)
        if body.end_of_stream:
            return self._pick_body(answers.route_headers, send_body=True)
        return []

    def _request_trailers(self) -> Iterable[Any]:
        """Trailers end a body that had no end_of_stream: pick now, send the body back
        without ending it (the trailers do)."""
        if self.phase is Phase.PICKED:
            return [answers.carry_on("request_trailers")]
        if self.phase is not Phase.BODY or self._buffered:
            return self._out_of_order("request_trailers")
        out = list(self._pick_body(answers.route_headers, send_body=True, end=False))
        if not self.finished:
            out.append(answers.carry_on("request_trailers"))
        return out

    def _pick_body(self, routed: Any, *, send_body: bool, end: bool = True) -> Iterable[Any]:
        body = bytes(self._body)
        try:
            if self._method == "POST":
                wanted = read_body(self._path, body, self._prompts, self._limits.max_prompt_tokens)
            else:
                wanted = Wanted()
        except Refused as refused:
            return self._refuse(refused)
        out = list(self._pick(wanted, routed=routed))
        if self.phase is Phase.PICKED and send_body:
            out.extend(answers.streamed_request_body(body, end))
        self.close()
        return out

    def _pick(self, wanted: Wanted, *, routed: Any) -> Iterable[Any]:
        if self._subset is not None and not self._subset:
            return self._refuse(
                Refused(503, "no_endpoint", "the gateway's endpoint subset is empty")
            )
        request = PickRequest(wanted.token_ids, wanted.cache_salt, wanted.model, self._subset)
        try:
            pick = self._picker.pick(request)
        except NoEndpoint as error:
            reason = " ".join(f"no endpoint: {error}".split())[:200]
            return self._refuse(Refused(503, "no_endpoint", reason))
        except Exception:
            _rare.exception("the picker failed; answered 503")
            return self._refuse(Refused(503, "picker_error", "the endpoint picker failed"))
        pick, changes = self._prefill.route(pick)
        self.phase = Phase.PICKED
        self._tally.count(200, str(pick.reason))
        prefill = f"prefill={pick.prefill.address}; " if pick.prefill is not None else ""
        self._pick_header = f"{pick.reason}; {prefill}cached_tokens={pick.cached_tokens}"
        return [routed(pick.endpoint, changes)]

    def _refuse(self, refused: Refused) -> Iterable[Any]:
        self.phase = Phase.DONE
        self._tally.count(refused.status, refused.reason)
        self.close()
        return [answers.immediate(refused.status, refused.message)]


def _header_text(header: Any) -> str:
    if header.raw_value:
        return bytes(header.raw_value).decode("latin-1")
    return str(header.value)


def _subset(metadata_context: Any) -> frozenset[str] | None:
    """The gateway's endpoint-subset hint: ``None`` when it sent none."""
    namespaces = metadata_context.filter_metadata
    if answers.SUBSET_NAMESPACE not in namespaces:
        return None
    fields = namespaces[answers.SUBSET_NAMESPACE].fields
    if answers.SUBSET_KEY not in fields:
        return None
    value = fields[answers.SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return frozenset(
            item.string_value
            for item in value.list_value.values
            if item.WhichOneof("kind") == "string_value" and item.string_value
        )
    if kind == "string_value":
        return frozenset(part.strip() for part in value.string_value.split(",") if part.strip())
    return frozenset()
