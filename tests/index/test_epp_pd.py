"""The ext_proc edge's answer to a disaggregated pick, over a real gRPC socket: the decode
pod as destination, the prefill pod signed for its sidecar (and in llm-d's header), the
pick header; and the client's own prefill headers removed from every other request."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvpool.common.disagg import PREFILL_HEADER, HeaderError, PrefillTarget, verify_prefill
from kvpool.common.index_config import PickerConfig, PrefillDecode
from kvpool.index.epp import EppServer
from kvpool.index.epp.answers import DESTINATION, PICK_HEADER, HeaderChanges
from kvpool.index.epp.prefill import LLMD_HEADER, PrefillHeaders
from kvpool.index.picking import Pick, PickReason, PrefillPod
from tests.index.test_picker import prompt, server
from tests.index.test_picker_pd import LONG, pd_picker, role

KEY = b"k" * 32
OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


@pytest.fixture
def epp(tmp_path: Path) -> Iterator[int]:
    key_file = tmp_path / "pd.key"
    key_file.write_bytes(KEY + b"\n")
    pd = PrefillDecode(enabled=True, key_file=key_file, llmd_header=True)
    servers = [
        role(server("10.0.0.1:8000", "n1"), "decode"),
        role(server("10.0.0.2:8000", "n2"), "prefill"),
    ]
    edge = EppServer(
        pd_picker(servers, pd=pd), PickerConfig(port=0, pd=pd), "127.0.0.1", None, prefill_key=KEY
    )
    port = edge.start()
    yield port
    edge.stop()


def exchange(port: int, tokens: list[int]) -> tuple[Any, Any]:
    """A completion whose client sent its own prefill headers: the headers' answer (the
    route) and the response headers' answer."""
    sent = [
        base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
        base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
        base_pb2.HeaderValue(key=PREFILL_HEADER, raw_value=b"10.6.6.6:80;evil;9999999999;00"),
        base_pb2.HeaderValue(key=LLMD_HEADER, raw_value=b"10.6.6.6:80"),
    ]
    body = json.dumps({"prompt": tokens, "cache_salt": "t"}).encode()
    messages = [
        pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=sent))
        ),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
        pb.ProcessingRequest(response_headers=pb.HttpHeaders(end_of_stream=True)),
    ]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        answers = list(pb_grpc.ExternalProcessorStub(channel).Process(iter(messages), timeout=10))
    route, *_, response = answers
    return route.request_headers.response.header_mutation, response


def picked(response: Any) -> str:
    (header,) = response.response_headers.response.header_mutation.set_headers
    assert header.header.key == PICK_HEADER
    return bytes(header.header.raw_value).decode()


def test_a_disaggregated_pick_names_the_signed_prefill_pod(epp: int) -> None:
    mutation, response = exchange(epp, prompt(LONG))
    headers = {h.header.key: bytes(h.header.raw_value).decode() for h in mutation.set_headers}
    assert headers[DESTINATION] == "10.0.0.1:8000"
    target = verify_prefill(KEY, headers[PREFILL_HEADER], time.time())
    assert (target.address, target.node) == ("10.0.0.2:8000", "n2")
    assert time.time() < target.expires <= time.time() + 30
    assert headers[LLMD_HEADER] == "10.0.0.2:8000"
    # the client's own values are replaced, not appended to
    assert all(h.append_action == OVERWRITE for h in mutation.set_headers[1:])
    assert picked(response) == "pd; prefill=10.0.0.2:8000; cached_tokens=0"
    with pytest.raises(HeaderError, match="signature"):
        verify_prefill(b"x" * 32, headers[PREFILL_HEADER], time.time())


def test_a_colocated_pick_removes_the_clients_prefill_headers(epp: int) -> None:
    mutation, response = exchange(epp, prompt(64))
    assert [h.header.key for h in mutation.set_headers] == [DESTINATION]
    assert list(mutation.remove_headers) == [PREFILL_HEADER, LLMD_HEADER]
    assert picked(response) == "load; cached_tokens=0"


def test_without_llmds_header_only_kvpools_is_set_and_removed() -> None:
    headers = PrefillHeaders(KEY, PrefillDecode(), clock=lambda: 1000.0)
    pod = PrefillPod("10.0.0.2:8000", "n2")
    pick = Pick("10.0.0.1:8000", PickReason.PD, 0, pod)
    routed, changes = headers.route(pick)
    assert routed == pick and [name for name, _ in changes.set] == [PREFILL_HEADER]
    assert verify_prefill(KEY, changes.set[0][1], 1030.0) == PrefillTarget(
        "10.0.0.2:8000", "n2", 1030
    )
    with pytest.raises(HeaderError, match="expired"):
        verify_prefill(KEY, changes.set[0][1], 1031.0)
    assert headers.route(Pick("10.0.0.1:8000", PickReason.LOAD)) == (
        Pick("10.0.0.1:8000", PickReason.LOAD),
        HeaderChanges(remove=(PREFILL_HEADER,)),
    )


def test_a_prefill_pod_the_header_cannot_name_is_not_followed() -> None:
    """A static server's address may hold what the signed header cannot carry: the request
    then goes whole to the decode pod, chosen by load (``fail_open``)."""
    headers = PrefillHeaders(KEY, PrefillDecode())
    odd = Pick("10.0.0.1:8000", PickReason.PD, 0, PrefillPod("odd;host:8000", "n2"))
    assert headers.route(odd) == (
        Pick("10.0.0.1:8000", PickReason.FAIL_OPEN),
        HeaderChanges(remove=(PREFILL_HEADER,)),
    )
