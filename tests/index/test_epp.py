"""The endpoint picker's edge behind a real Envoy: requests reach the backend the picker
chose with their bodies intact, responses come back, refusals are one-line answers, and
a fail-open gateway still serves with the picker down."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool.common.index_config import PickerConfig
from kvpool.index.epp import EppServer
from kvpool.index.epp.answers import PICK_HEADER
from kvpool.index.epp.server import HEALTH_SERVICES
from kvpool.index.picking import NoEndpoint, Pick, PickReason, PickRequest
from kvpool.index.prompts import Prompts
from tests.index.test_prompts import write_tokenizer
from tests.support.envoy import SERVED_BY, Envoy
from tests.support.polling import wait_until

pytestmark = pytest.mark.process  # Envoy

MAX_BODY = 512 << 10
MAX_TOKENS = 60_000


class Backend:
    """A model server stand-in: answers what it received (its port, the body's length
    and digest, the destination header), or the body itself (``"echo": true``), or a
    chunked stream (``"stream": true``)."""

    def __init__(self) -> None:
        backend = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self._answer(b"")

            def do_POST(self) -> None:
                self._answer(self._body())

            def _body(self) -> bytes:
                if self.headers.get("transfer-encoding") == "chunked":
                    data = b""
                    while size := int(self.rfile.readline().strip(), 16):
                        data += self.rfile.read(size)
                        self.rfile.readline()
                    self.rfile.readline()
                    return data
                return self.rfile.read(int(self.headers.get("content-length") or 0))

            def _answer(self, body: bytes) -> None:
                asked = json.loads(body) if body.startswith(b"{") else {}
                if asked.get("stream"):
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream")
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    for n in range(5):
                        chunk = f"data: {n} {backend.port}\n\n".encode()
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                        time.sleep(0.02)
                    self.wfile.write(b"0\r\n\r\n")
                    return
                if asked.get("echo"):
                    out = body
                else:
                    out = json.dumps(
                        {
                            "port": backend.port,
                            "method": self.command,
                            "path": self.path,
                            "length": len(body),
                            "sha256": hashlib.sha256(body).hexdigest(),
                            "destination": self.headers.get("x-gateway-destination-endpoint"),
                        }
                    ).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.endpoint = f"127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class PortPicker:
    """Picks the endpoint whose port is the prompt's first token id (else the first
    allowed), within the subset; remembers what it was asked; ``mode`` makes it fail."""

    endpoints: list[str]
    seen: list[PickRequest] = field(default_factory=list)
    mode: str = "pick"

    def pick(self, request: PickRequest) -> Pick:
        self.seen.append(request)
        if self.mode == "no_endpoint":
            raise NoEndpoint("none is ready")
        if self.mode == "crash":
            raise RuntimeError("the picker broke")
        allowed = [e for e in self.endpoints if request.subset is None or e in request.subset]
        if not allowed:
            raise NoEndpoint("none in the subset")
        if request.token_ids:
            named = f"127.0.0.1:{request.token_ids[0]}"
            if named in allowed:
                return Pick(named, PickReason.PREFIX, len(request.token_ids))
        return Pick(allowed[0], PickReason.LOAD)


@pytest.fixture(scope="module")
def backends() -> Iterator[list[Backend]]:
    made = [Backend(), Backend(), Backend()]
    yield made
    for backend in made:
        backend.stop()


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Prompts:
    return Prompts.load(write_tokenizer(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture(scope="module")
def picker(backends: list[Backend]) -> PortPicker:
    return PortPicker([b.endpoint for b in backends[:2]])


def _server(picker: Any, prompts: Prompts | None = None, **bounds: Any) -> EppServer:
    config = PickerConfig(port=0, max_body_bytes=MAX_BODY, max_prompt_tokens=MAX_TOKENS)
    return EppServer(picker, config, "127.0.0.1", prompts, **bounds)


@pytest.fixture(scope="module")
def epp(picker: PortPicker, prompts: Prompts) -> Iterator[tuple[EppServer, int]]:
    server = _server(picker, prompts)
    port = server.start()
    yield server, port
    server.stop()


@pytest.fixture(scope="module")
def gateway(
    epp: tuple[EppServer, int], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[httpx.Client]:
    envoy = Envoy(f"127.0.0.1:{epp[1]}", tmp_path_factory.mktemp("envoy")).start()
    with httpx.Client(base_url=envoy.url, timeout=20) as client:
        yield client
    envoy.stop()


@pytest.fixture
def seen(picker: PortPicker) -> Iterator[list[PickRequest]]:
    picker.seen.clear()
    picker.mode = "pick"
    yield picker.seen
    picker.mode = "pick"


def test_a_completion_reaches_the_picked_backend_with_its_body(
    gateway: httpx.Client, backends: list[Backend], seen: list[PickRequest]
) -> None:
    for backend in backends[:2]:
        body = json.dumps(
            {"model": "m", "prompt": [backend.port, 7, 8], "cache_salt": "tenant-a"}
        ).encode()
        answer = gateway.post("/v1/completions", content=body)
        assert answer.status_code == 200, answer.text
        got = answer.json()
        assert got["port"] == backend.port
        assert got["destination"] == backend.endpoint
        assert got["sha256"] == hashlib.sha256(body).hexdigest()
        assert seen[-1] == PickRequest((backend.port, 7, 8), "tenant-a", "m", None)
        assert answer.headers[SERVED_BY] == backend.endpoint
        assert answer.headers[PICK_HEADER] == "prefix; cached_tokens=3"  # the picker's answer


def test_a_large_body_is_streamed_to_the_backend_intact(
    gateway: httpx.Client, backends: list[Backend], seen: list[PickRequest]
) -> None:
    prompt = [backends[1].port, *range(40_000)]
    body = json.dumps({"prompt": prompt, "echo": True}).encode()
    assert 62_000 * 3 < len(body) < MAX_BODY
    answer = gateway.post("/v1/completions", content=body)
    assert answer.status_code == 200
    assert answer.content == body  # there and back, both ways through the picker
    assert len(seen[-1].token_ids) == len(prompt)


def test_a_streamed_response_comes_back_chunk_by_chunk(
    gateway: httpx.Client, backends: list[Backend]
) -> None:
    body = {"prompt": [backends[0].port], "stream": True}
    with gateway.stream("POST", "/v1/completions", json=body) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"] == "text/event-stream"
        text = b"".join(answer.iter_bytes()).decode()
    assert text == "".join(f"data: {n} {backends[0].port}\n\n" for n in range(5))


def test_a_chat_is_tokenized_with_the_template(
    gateway: httpx.Client, prompts: Prompts, seen: list[PickRequest]
) -> None:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "text", "text": "What is the capital?"}]},
    ]
    answer = gateway.post("/v1/chat/completions", json={"model": "m", "messages": messages})
    assert answer.status_code == 200
    expected = prompts.chat([messages[0], {"role": "user", "content": "What is the capital?"}])
    assert list(seen[-1].token_ids) == expected and expected[0] == 1
    # the request's own fields win over chat_template_kwargs, as in vLLM
    answer = gateway.post(
        "/v1/chat/completions",
        json={
            "messages": messages[:1],
            "add_generation_prompt": False,
            "chat_template_kwargs": {"add_generation_prompt": True},
        },
    )
    assert answer.status_code == 200
    assert list(seen[-1].token_ids) == prompts.chat(messages[:1], add_generation_prompt=False)
    # a completion's text gets the tokenizer's BOS; a template the chat breaks: by load
    gateway.post("/v1/completions", json={"prompt": "hello world"})
    assert list(seen[-1].token_ids) == prompts.encode("hello world")
    broken = [{"role": "assistant", "content": "I start"}]  # the template raises
    answer = gateway.post("/v1/chat/completions", json={"messages": broken})
    assert answer.status_code == 200 and seen[-1].token_ids == ()


def test_a_get_without_a_body_is_picked_by_load(
    gateway: httpx.Client, backends: list[Backend], seen: list[PickRequest]
) -> None:
    answer = gateway.get("/v1/models")
    assert answer.status_code == 200
    assert answer.json()["method"] == "GET" and answer.json()["path"] == "/v1/models"
    assert seen[-1] == PickRequest((), None, None, None)


@pytest.mark.parametrize(
    "case",
    [
        (b"{not json", 400, "the body is not JSON"),
        (b"[1, 2]", 400, "the body is not a JSON object"),
        (b'{"model": "m"}', 400, "prompt is missing"),
        (b'{"prompt": [1, -2]}', 400, "prompt must hold token ids"),
        (b'{"prompt": [1, 2.5]}', 400, "prompt must hold token ids"),
        (b'{"prompt": [1, 4294967296]}', 400, "prompt must hold token ids"),
        (b'{"prompt": [1, true]}', 400, "prompt must hold token ids"),
        (b'{"prompt": [[1], "a"]}', 400, "prompt must be a batch of strings or"),
        (b'{"prompt": []}', 400, "prompt must be a string, token ids"),
        (b'{"prompt": {"a": 1}}', 400, "prompt must be a string, token ids"),
        (b'{"prompt": [1], "model": []}', 400, "model must be a string"),
        (b'{"prompt": [1], "add_special_tokens": "yes"}', 400, "add_special_tokens must be"),
        (b'{"prompt": "x", "cache_salt": 5}', 400, "cache_salt must be a string"),
        (
            b'{"prompt": [' + b"1," * 60_000 + b"1]}",
            413,
            "the prompt has 60001 tokens, more than the picker's 60000",
        ),
        (
            b'{"prompt": "' + b"a" * MAX_BODY + b'"}',
            413,
            "the request body is larger than the picker reads",
        ),
        (b"[" * 100_000, 400, "the body is not JSON"),
    ],
)
def test_bad_bodies_get_one_line_refusals_and_the_picker_serves_on(
    gateway: httpx.Client,
    backends: list[Backend],
    epp: tuple[EppServer, int],
    case: tuple[bytes, int, str],
) -> None:
    body, status, reason = case
    answer = gateway.post("/v1/completions", content=body)
    assert answer.status_code == status
    assert answer.text.startswith(reason) and answer.text.count("\n") == 1, answer.text
    assert answer.headers["content-type"].startswith("text/plain")
    kind = {400: "bad_request", 413: ""}[status]
    assert any(s == status and (not kind or r == kind) for s, r in epp[0].answers.snapshot())
    ok = gateway.post("/v1/completions", json={"prompt": [backends[0].port]})
    assert ok.status_code == 200 and ok.json()["port"] == backends[0].port


def test_no_endpoint_and_a_failing_picker_are_503(
    gateway: httpx.Client, picker: PortPicker, seen: list[PickRequest], epp: tuple[EppServer, int]
) -> None:
    picker.mode = "no_endpoint"
    answer = gateway.post("/v1/completions", json={"prompt": [1]})
    assert answer.status_code == 503 and answer.text == "no endpoint: none is ready\n"
    picker.mode = "crash"
    answer = gateway.post("/v1/completions", json={"prompt": [1]})
    assert answer.status_code == 503 and answer.text == "the endpoint picker failed\n"
    assert gateway.get("/v1/models").status_code == 503
    picker.mode = "pick"
    assert gateway.get("/v1/models").status_code == 200
    counts = epp[0].answers.snapshot()
    assert counts[(503, "no_endpoint")] >= 1 and counts[(503, "picker_error")] >= 2
    assert counts[(200, "load")] >= 1


def test_the_gateways_subset_hint_reaches_the_picker(
    epp: tuple[EppServer, int],
    backends: list[Backend],
    seen: list[PickRequest],
    tmp_path: Path,
) -> None:
    only = backends[1].endpoint
    envoy = Envoy(f"127.0.0.1:{epp[1]}", tmp_path, subset=[only]).start()
    empty = Envoy(f"127.0.0.1:{epp[1]}", tmp_path, subset=[]).start()
    try:
        # the prompt names the other backend; the subset wins
        answer = httpx.post(
            f"{envoy.url}/v1/completions", json={"prompt": [backends[0].port]}, timeout=20
        )
        assert answer.status_code == 200 and answer.json()["port"] == backends[1].port
        assert seen[-1].subset == frozenset({only})
        answer = httpx.post(f"{empty.url}/v1/completions", json={"prompt": [1]}, timeout=20)
        assert answer.status_code == 503
        assert answer.text == "the gateway's endpoint subset is empty\n"
    finally:
        envoy.stop()
        empty.stop()


def test_buffered_bodies_are_routed_too(
    epp: tuple[EppServer, int], backends: list[Backend], tmp_path: Path
) -> None:
    envoy = Envoy(
        f"127.0.0.1:{epp[1]}",
        tmp_path,
        request_body_mode="BUFFERED",
        response_body_mode="NONE",
    ).start()
    try:
        body = json.dumps({"prompt": [backends[1].port, *range(20_000)]}).encode()
        answer = httpx.post(f"{envoy.url}/v1/completions", content=body, timeout=20)
        assert answer.status_code == 200, answer.text
        assert answer.json()["port"] == backends[1].port
        assert answer.json()["sha256"] == hashlib.sha256(body).hexdigest()
        bad = httpx.post(f"{envoy.url}/v1/completions", content=b"{", timeout=20)
        assert bad.status_code == 400
    finally:
        envoy.stop()


def test_health_answers_serving(epp: tuple[EppServer, int]) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{epp[1]}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in HEALTH_SERVICES:
            answer = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_fail_open_routes_around_a_stopped_picker(
    picker: PortPicker, backends: list[Backend], tmp_path: Path
) -> None:
    """FailOpen: with the picker down (Envoy's health check says so) the fallback route
    serves; a client cannot name its own destination (the gateway removes the header
    before the picker). FailClose: 500."""
    server = _server(picker)
    port = server.start()
    fallback = [b.endpoint for b in backends[:2]]
    open_ = Envoy(f"127.0.0.1:{port}", tmp_path, failure_mode_allow=True, fallback=fallback).start()
    closed = Envoy(f"127.0.0.1:{port}", tmp_path).start()
    try:
        wait_until(open_.picker_healthy, what="Envoy sees the picker")
        routed = httpx.post(f"{open_.url}/v1/completions", json={"prompt": [backends[1].port]})
        assert routed.json()["destination"] == backends[1].endpoint
        server.stop()
        wait_until(lambda: not open_.picker_healthy(), what="Envoy sees the picker down")
        wait_until(lambda: not closed.picker_healthy(), what="Envoy sees the picker down")
        served = set()
        for _ in range(6):
            answer = httpx.post(
                f"{open_.url}/v1/completions",
                json={"prompt": [backends[2].port]},
                headers={"x-gateway-destination-endpoint": backends[2].endpoint},
                timeout=20,
            )
            assert answer.status_code == 200, answer.text
            served.add(answer.json()["port"])
            assert answer.json()["destination"] is None
        assert served == {backends[0].port, backends[1].port}
        refused = httpx.post(f"{closed.url}/v1/completions", json={"prompt": [1]}, timeout=20)
        assert refused.status_code == 500
    finally:
        server.stop()
        open_.stop()
        closed.stop()


def _open_stream(port: int) -> tuple[grpc.Channel, Any]:
    """A raw ext_proc stream that sends nothing, on a connection of its own (HTTP/2
    would queue streams past the server's per-connection limit in the client)."""
    channel = grpc.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
    )
    stub = pb_grpc.ExternalProcessorStub(channel)
    hold = threading.Event()

    def nothing() -> Iterator[Any]:
        hold.wait(30)
        return
        yield pb.ProcessingRequest()

    call = stub.Process(nothing(), timeout=30)
    call.hold = hold
    return channel, call


def test_idle_streams_are_cancelled_and_streams_are_bounded(picker: PortPicker) -> None:
    server = _server(picker, max_streams=2, request_seconds=3.0)
    port = server.start()
    try:
        opened = [_open_stream(port) for _ in range(3)]
        codes = []
        started = time.monotonic()
        for _, call in opened:
            with pytest.raises(grpc.RpcError) as caught:
                next(call)
            codes.append(caught.value.code())
        # the third finds no room at once; the two idle ones are cancelled after ~3 s
        assert sorted(c.name for c in codes).count("CANCELLED") == 2, codes
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
        assert time.monotonic() - started < 15
        for channel, call in opened:
            call.hold.set()
            channel.close()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            assert check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
    finally:
        server.stop()


def test_start_binds_a_free_port_and_refuses_a_taken_one(picker: PortPicker) -> None:
    first = _server(picker)
    port = first.start()
    try:
        taken = EppServer(picker, PickerConfig(port=port), "127.0.0.1", None)
        with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
            taken.start()
    finally:
        first.stop()


def _headers(end_of_stream: bool = False, **metadata: Any) -> Any:
    from envoy.config.core.v3 import base_pb2

    request = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
                    base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
                ]
            ),
            end_of_stream=end_of_stream,
        )
    )
    for namespace, value in metadata.items():
        request.metadata_context.filter_metadata[namespace].update(value)
    return request


def test_odd_streams_end_quietly_and_the_picker_serves_on(
    epp: tuple[EppServer, int], picker: PortPicker, seen: list[PickRequest]
) -> None:
    """Anything a peer on the network can send: messages out of order, a body mode the
    edge does not speak, a malformed subset hint. Each stream ends (OK, or a refusal),
    none takes the server down."""
    body = pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{}", end_of_stream=True))
    response = pb.ProcessingRequest(response_body=pb.HttpBody(body=b"x", end_of_stream=True))
    streamed = _headers()
    streamed.protocol_config.request_body_mode = 1  # STREAMED
    hint = "envoy.lb.subset_hint"
    sequences = {
        "response first": [response],
        "body first": [body],
        "headers twice": [_headers(), _headers()],
        "streamed mode": [streamed],
        "subset a number": [_headers(True, **{hint: {"x-gateway-destination-endpoint-subset": 5}})],
        "subset a string": [
            _headers(True, **{hint: {"x-gateway-destination-endpoint-subset": "127.0.0.1:1, b"}})
        ],
    }
    answered = {}
    with grpc.insecure_channel(f"127.0.0.1:{epp[1]}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        for name, messages in sequences.items():
            answers = list(stub.Process(iter(messages), timeout=10))
            answered[name] = [
                (a.WhichOneof("response"), a.immediate_response.status.code) for a in answers
            ]
    assert answered["response first"] == []
    assert answered["body first"] == []
    assert answered["headers twice"] == []
    assert answered["streamed mode"] == [("immediate_response", 500)]
    assert answered["subset a number"] == [("immediate_response", 503)]
    assert answered["subset a string"] == [("immediate_response", 503)]  # none of those
    assert seen[-1].subset == frozenset({"127.0.0.1:1", "b"})


def test_the_body_comes_back_in_chunks_of_at_most_62000_bytes(
    epp: tuple[EppServer, int], backends: list[Backend]
) -> None:
    body = json.dumps({"prompt": [backends[0].port, *range(30_000)]}).encode()
    halves = [body[: len(body) // 2], body[len(body) // 2 :]]
    messages = [
        _headers(),
        *(
            pb.ProcessingRequest(request_body=pb.HttpBody(body=half, end_of_stream=last))
            for half, last in zip(halves, [False, True], strict=True)
        ),
    ]
    with grpc.insecure_channel(f"127.0.0.1:{epp[1]}") as channel:
        answers = list(pb_grpc.ExternalProcessorStub(channel).Process(iter(messages), timeout=10))
    route, *chunks = answers
    mutation = route.request_headers.response.header_mutation.set_headers[0].header
    assert (mutation.key, mutation.raw_value) == (
        "x-gateway-destination-endpoint",
        backends[0].endpoint.encode(),
    )
    lb = route.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert lb["x-gateway-destination-endpoint"].string_value == backends[0].endpoint
    streamed = [c.request_body.response.body_mutation.streamed_response for c in chunks]
    assert all(len(s.body) <= 62_000 for s in streamed) and len(streamed) == 4
    assert [s.end_of_stream for s in streamed] == [False, False, False, True]
    assert b"".join(s.body for s in streamed) == body


class _Feed:
    """A raw ext_proc stream whose messages the test sends one by one."""

    def __init__(self, port: int) -> None:
        import queue

        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
        )
        self._queue: queue.Queue[Any] = queue.Queue()
        self.call = pb_grpc.ExternalProcessorStub(self.channel).Process(
            iter(self._queue.get, None), timeout=30
        )

    def send(self, message: Any) -> None:
        self._queue.put(message)

    def close(self) -> None:
        self._queue.put(None)
        self.channel.close()


def test_bodies_share_a_memory_budget_and_routed_streams_an_idle_limit(
    picker: PortPicker,
) -> None:
    server = _server(picker, body_budget_bytes=100_000, idle_seconds=1.0)
    port = server.start()
    feeds = [_Feed(port) for _ in range(3)]
    try:
        chunk = pb.ProcessingRequest(request_body=pb.HttpBody(body=b" " * 60_000))
        for feed in feeds[:2]:
            feed.send(_headers())
            feed.send(chunk)
            wait_until(lambda: server.budget.held == 60_000, what="the first body held")
        busy = next(feeds[1].call)  # the second 60 kB does not fit beside the first
        assert busy.immediate_response.status.code == 503
        assert busy.immediate_response.body == b"the picker holds too many bodies now\n"
        assert server.answers.snapshot()[(503, "busy")] == 1
        # a routed stream that then says nothing is cancelled after idle_seconds
        feeds[2].send(_headers(end_of_stream=True))
        assert next(feeds[2].call).HasField("request_headers")
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            next(feeds[2].call)
        assert caught.value.code() == grpc.StatusCode.CANCELLED
        assert 0.5 < time.monotonic() - started < 10
    finally:
        for feed in feeds:
            feed.close()
        server.stop()


def test_trailers_end_a_body_without_end_of_stream(
    epp: tuple[EppServer, int], backends: list[Backend]
) -> None:
    """A request with trailers: its last body chunk does not end the stream, the trailers
    do; the body goes back unended and the trailers pass."""
    body = json.dumps({"prompt": [backends[1].port]}).encode()
    messages = [
        _headers(),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=False)),
        pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
    ]
    with grpc.insecure_channel(f"127.0.0.1:{epp[1]}") as channel:
        answers = list(pb_grpc.ExternalProcessorStub(channel).Process(iter(messages), timeout=10))
    assert [a.WhichOneof("response") for a in answers] == [
        "request_headers",
        "request_body",
        "request_trailers",
    ]
    streamed = answers[1].request_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (body, False)
    header = answers[0].request_headers.response.header_mutation.set_headers[0].header
    assert header.raw_value == backends[1].endpoint.encode()
