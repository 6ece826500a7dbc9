"""gRPC plumbing without generated code: a service as a table of methods, each logged in
one line with its outcome, and refusals as gRPC statuses."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)


class Refusal(Exception):
    """A request refused with a gRPC status code and one line naming the value."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _nothing(_request: Any) -> str:
    return ""


@dataclass(frozen=True)
class Method:
    name: str
    request: Any
    """The request's message class."""
    handle: Callable[[Any], Any]
    """The request to the response message; raises :class:`Refusal` to refuse."""
    summary: Callable[[Any], str] = _nothing
    """What the log line says of a request (never a secret)."""


def service(name: str, methods: Sequence[Method]) -> grpc.GenericRpcHandler:
    """The handler of service ``name`` (``package.Service``) with unary ``methods``."""
    return grpc.method_handlers_generic_handler(
        name, {method.name: _unary(method) for method in methods}
    )


def _unary(method: Method) -> grpc.RpcMethodHandler:
    def behaviour(request: Any, context: grpc.ServicerContext) -> Any:
        summary = method.summary(request)
        said = f"{method.name} {summary}".rstrip()
        try:
            response = method.handle(request)
        except Refusal as refusal:
            log.warning("%s: %s: %s", said, refusal.code.name, refusal.message)
            context.abort(refusal.code, refusal.message)
        except Exception as error:
            log.exception("%s: failed", said)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")
        log.info("%s: OK", said)
        return response

    return grpc.unary_unary_rpc_method_handler(
        behaviour,
        request_deserializer=method.request.FromString,
        response_serializer=lambda message: message.SerializeToString(),
    )


def serve(socket: Path, handlers: Sequence[grpc.GenericRpcHandler]) -> grpc.Server:
    """A started server of ``handlers`` on the unix socket ``socket`` (a stale socket file
    there is replaced)."""
    with contextlib.suppress(FileNotFoundError):
        if socket.is_socket():
            socket.unlink()
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers(tuple(handlers))
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    return server


def stop(server: grpc.Server, socket: Path, grace: float) -> None:
    """Stop ``server`` (its calls in flight get ``grace`` seconds) and remove its socket."""
    server.stop(grace).wait(grace + 1)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket)
