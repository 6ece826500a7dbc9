"""The picker check against real gRPC servers: a health servicer (grpcio-health-checking's,
as the picker serves it) that reports SERVING or NOT_SERVING for the ext_proc service, a
port nobody listens on, and a TCP server that accepts and never answers; then ``kvpool
doctor`` as a process, finding the picker through the index's ConfigMap."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvpool.common.index_config import PickerConfig
from kvpool.index.epp.server import EppServer
from kvpool.index.picking import Pick, PickRequest
from kvpool.operator.render import Pool, render
from kvpool.operator.spec import PoolSpec
from kvpool.tools.doctor.picker import EXT_PROC_SERVICE, NAME, probe
from kvpool.tools.doctor.report import Outcome
from tests.support.kube_api import ServedApi

from .conftest import run_doctor

NAMESPACE = "inference"
POOL = Pool("main", NAMESPACE, "0f1e2d3c-0000-4000-8000-000000000001")
TOKENS = {"tenants": {"tokensSecretRef": {"name": "kvpool-main-tokens"}}}
FINGERPRINT = {"model": "m", "dtype": "bfloat16", "kvLayout": "nhd"}


@contextlib.contextmanager
def health_server(status: Any) -> Iterator[str]:
    """A gRPC server on loopback whose health service reports ``status`` for the ext_proc
    service (and SERVING for ""), as the picker's does."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set(EXT_PROC_SERVICE, status)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


@contextlib.contextmanager
def silent_server() -> Iterator[str]:
    """A TCP listener that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield f"127.0.0.1:{listener.getsockname()[1]}"


def _free_port() -> int:
    with socket.socket() as probe_socket:
        probe_socket.bind(("127.0.0.1", 0))
        port: int = probe_socket.getsockname()[1]
    return port


def test_a_serving_picker_passes() -> None:
    with health_server(health_pb2.HealthCheckResponse.SERVING) as address:
        check = probe(address, timeout=2)
    assert (check.name, check.outcome) == (NAME, Outcome.PASS)
    assert address in check.seen and "SERVING" in check.seen


def test_kvpools_picker_server_passes() -> None:
    """The check asks what kvpool's own picker edge (EppServer) answers."""
    server = EppServer(_Unused(), PickerConfig(port=0), "127.0.0.1", None)
    port = server.start()
    try:
        check = probe(f"127.0.0.1:{port}", timeout=2)
    finally:
        server.stop(grace=0)
    assert check.outcome is Outcome.PASS, check


class _Unused:
    """A picker core the health check never reaches."""

    def pick(self, request: PickRequest) -> Pick:
        raise AssertionError("a health check picks nothing")


def test_a_picker_that_is_not_serving_fails_saying_so() -> None:
    with health_server(health_pb2.HealthCheckResponse.NOT_SERVING) as address:
        check = probe(address, timeout=2)
    assert check.outcome is Outcome.FAIL
    assert f"answers NOT_SERVING for {EXT_PROC_SERVICE}" in check.seen
    assert check.fix is not None and "\n" not in check.seen + check.fix


def test_a_server_without_the_ext_proc_service_fails() -> None:
    """A gRPC server whose health service does not know the ext_proc service (another
    server on the port): NOT_FOUND, in one line."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        check = probe(f"127.0.0.1:{port}", timeout=2)
    finally:
        server.stop(grace=None)
    assert check.outcome is Outcome.FAIL
    assert "NOT_FOUND" in check.seen and "\n" not in check.seen


def test_nobody_listening_fails_in_one_line() -> None:
    address = f"127.0.0.1:{_free_port()}"
    check = probe(address, timeout=1)
    assert check.outcome is Outcome.FAIL
    assert check.seen.startswith(f"the endpoint picker at {address} does not answer")
    assert "UNAVAILABLE" in check.seen and "\n" not in check.seen
    assert check.fix is not None and "pickerClients" in check.fix


def test_a_server_that_never_answers_fails_within_the_timeout() -> None:
    with silent_server() as address:
        started = time.monotonic()
        check = probe(address, timeout=1)
        elapsed = time.monotonic() - started
    assert check.outcome is Outcome.FAIL and "DEADLINE_EXCEEDED" in check.seen
    assert elapsed < 5


@pytest.fixture
def index_config(served_api: ServedApi) -> Iterator[Any]:
    """A function that stores the pool's Service (the doctor finds the pool by it) and the
    index ConfigMap that the operator renders for ``picker``."""
    core = served_api.core_api()
    with contextlib.suppress(Exception):  # another test of the session made it
        core.create_namespace({"metadata": {"name": NAMESPACE}})

    def store(picker: dict[str, Any]) -> None:
        index = {"enabled": True, "fingerprint": FINGERPRINT, "picker": picker}
        spec = PoolSpec.parse({**TOKENS, "index": index})
        children = render(POOL, spec, default_image="kvpool:test")
        assert children.index is not None
        core.create_namespaced_service(NAMESPACE, children.service)
        core.create_namespaced_config_map(NAMESPACE, children.index.config)

    yield store
    core.delete_namespaced_config_map(POOL.index_config_name, NAMESPACE)
    core.delete_namespaced_service(POOL.service_name, NAMESPACE)


pytestmark = pytest.mark.process


def _doctor(served_api: ServedApi, *args: str) -> Any:
    env = {"KUBECONFIG": str(served_api.kubeconfig())}
    return run_doctor(
        "--pool", "main", "--namespace", NAMESPACE, "--timeout", "1", *args, env=env
    ).checks[NAME]


def test_the_doctor_finds_the_picker_through_the_index_configmap(
    served_api: ServedApi, index_config: Any
) -> None:
    index_config({"enabled": True, "port": 9002, "selector": {"app": "vllm"}})
    # the Service's name resolves only in a cluster: here, one clear line
    check = _doctor(served_api)
    assert check.outcome == "FAIL"
    assert check.seen.startswith("the endpoint picker at kvpool-main-index.inference.svc:9002")
    # --picker reaches it where the Service does not (a port-forward)
    with health_server(health_pb2.HealthCheckResponse.SERVING) as address:
        check = _doctor(served_api, "--picker", address)
    assert check.outcome == "PASS", check


def test_the_doctor_skips_a_pool_whose_index_serves_no_picker(
    served_api: ServedApi, index_config: Any
) -> None:
    index_config({"enabled": False})
    check = _doctor(served_api)
    assert check.outcome == "SKIP" and "spec.index.picker.enabled is false" in check.seen
