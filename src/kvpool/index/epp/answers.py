"""The ext_proc replies the edge sends Envoy, built in one place.

Envoy routes on the ``x-gateway-destination-endpoint`` request header (an ORIGINAL_DST
cluster); the Gateway API Inference Extension's protocol asks for the same value in the
``envoy.lb`` dynamic metadata too, for gateways that route on metadata.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

DESTINATION = "x-gateway-destination-endpoint"
"""The header (and ``envoy.lb`` metadata key) naming the picked ``ip:port``."""
DESTINATION_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
BODY_CHUNK_BYTES = 62000
"""Largest body chunk sent back in one message (the protocol's and GAIE's limit)."""


class HeaderChanges(NamedTuple):
    """Request headers a route sets besides the destination, and those it removes."""

    set: Sequence[tuple[str, str]] = ()
    """Each replaces whatever the client sent under its name."""
    remove: Sequence[str] = ()


def _route_common(endpoint: str, changes: HeaderChanges) -> Any:
    headers = [
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=DESTINATION, raw_value=endpoint.encode())
        ),
        *(
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
            for key, value in changes.set
        ),
    ]
    mutation = pb.HeaderMutation(set_headers=headers, remove_headers=list(changes.remove))
    return pb.CommonResponse(clear_route_cache=True, header_mutation=mutation)


def _metadata(endpoint: str) -> Any:
    metadata = struct_pb2.Struct()
    metadata.update({DESTINATION_NAMESPACE: {DESTINATION: endpoint}})
    return metadata


def route_headers(endpoint: str, changes: HeaderChanges) -> Any:
    """The request headers' answer that sends the request to ``endpoint``."""
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=_route_common(endpoint, changes)),
        dynamic_metadata=_metadata(endpoint),
    )


def route_buffered_body(endpoint: str, changes: HeaderChanges) -> Any:
    """The answer to a buffered request body that sends the request to ``endpoint`` (in
    BUFFERED mode Envoy holds the headers until the body's answer, which may mutate them)."""
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(response=_route_common(endpoint, changes)),
        dynamic_metadata=_metadata(endpoint),
    )


def streamed_request_body(body: bytes, end: bool = True) -> Iterator[Any]:
    """``body`` back to Envoy in chunks, the last one ending the stream if ``end`` (not
    when trailers follow; one empty chunk for an empty body)."""
    for start in range(0, max(len(body), 1), BODY_CHUNK_BYTES):
        chunk = body[start : start + BODY_CHUNK_BYTES]
        yield _streamed("request_body", chunk, end and start + BODY_CHUNK_BYTES >= len(body))


def streamed_response_body(chunk: bytes, end_of_stream: bool) -> Any:
    """A response body chunk echoed unchanged (in FULL_DUPLEX_STREAMED mode what is not
    sent back never reaches the client)."""
    return _streamed("response_body", chunk, end_of_stream)


def _streamed(kind: str, chunk: bytes, end_of_stream: bool) -> Any:
    mutation = pb.BodyMutation(
        streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=end_of_stream)
    )
    body = pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
    return pb.ProcessingResponse(**{kind: body})


def carry_on(kind: str) -> Any:
    """The answer that lets a message of ``kind`` (``request_headers``, ``response_headers``,
    ``response_body``, ``request_trailers``, ``response_trailers``) through unchanged."""
    if kind.endswith("_headers"):
        return pb.ProcessingResponse(**{kind: pb.HeadersResponse(response=pb.CommonResponse())})
    if kind.endswith("_body"):
        return pb.ProcessingResponse(**{kind: pb.BodyResponse(response=pb.CommonResponse())})
    return pb.ProcessingResponse(**{kind: pb.TrailersResponse()})


PICK_HEADER = "x-kvpool-pick"
"""The response header that says why the picker chose the endpoint, and how much of the
prompt it expected the endpoint to load: ``prefix; cached_tokens=1792``. It tells the
client only of its own prompt's chunks (its salt's), as ``usage.cached_tokens`` does."""


def pick_header(value: str) -> Any:
    """The answer to the response's headers: they go on, with :data:`PICK_HEADER` added."""
    header = base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=PICK_HEADER, raw_value=value.encode())
    )
    mutation = pb.HeaderMutation(set_headers=[header])
    return pb.ProcessingResponse(
        response_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=mutation))
    )


def immediate(status: int, reason: str) -> Any:
    """Envoy answers the client itself: ``status`` with ``reason`` as a one-line text body."""
    header = base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key="content-type", raw_value=b"text/plain; charset=utf-8")
    )
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=[header]),
            body=(reason + "\n").encode(),
            details=f"kvpool_epp_{status}",
        )
    )
