"""``kvpool-pd-sidecar``: the decode pod's sidecar of prefill/decode disaggregation.

Flags only (it runs beside vLLM in the same pod, configured by the pod's manifest). A flag
or a key file it cannot use stops it at start in one line (exit 2); without
``--key-file`` it runs as a pure pass-through that strips the prefill headers, and says so.
SIGTERM and SIGINT stop it. Its own counts are not metrics: ``/metrics`` on its port is
vLLM's (the endpoint picker scrapes it through this port), and what the sidecar did with a
request is in each response's result header, for the gateway's access log.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Sequence
from pathlib import Path

import httpx

from kvpool import __version__
from kvpool.common.config import HttpLimits
from kvpool.common.disagg import PREFILL_HEADER, read_key
from kvpool.common.names import (
    DEFAULT_PD_DECODE_WAIT_MS,
    DEFAULT_PD_PREFILL_TIMEOUT_SECONDS,
    DEFAULT_PD_VLLM_PORT,
    MAX_PD_DECODE_WAIT_MS,
    NODE_NAME_ENV,
)
from kvpool.common.problems import (
    ArgumentParser,
    ConfigError,
    exit_with,
    listening,
    number,
    start_logging,
)
from kvpool.common.web.body_gate import BodyGate
from kvpool.common.web.serving import listen, serve_http
from kvpool.sidecar.proxy import Sidecar
from kvpool.sidecar.settings import SidecarSettings

log = logging.getLogger(__name__)

PROG = "kvpool-pd-sidecar"
DEFAULT_MAX_BODY_BYTES = 8 << 20
"""Chat requests carry images as base64: a few MiB is an ordinary body."""
CONNECT_TIMEOUT_S = 5.0
KEEPALIVE_S = 3.0
"""How long an idle connection to vLLM (or a prefill pod) is kept for the next request."""


def http_url(text: str) -> str:
    """``http://host:port``, no path: the local vLLM server's base URL."""
    url = httpx.URL(text)
    if url.scheme != "http" or not url.host or url.path not in ("", "/") or url.query:
        raise argparse.ArgumentTypeError(f"expected http://HOST:PORT, not {text!r}")
    return str(url).rstrip("/")


def parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog=PROG,
        description="The decode pod's sidecar of prefill/decode disaggregation: proxies the "
        "pod's port to the local vLLM, and runs the prefill of a request on the pod the "
        f"endpoint picker named in a signed {PREFILL_HEADER} header (docs/operations/"
        "disaggregation.md).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--host", default="0.0.0.0", help="address to listen on (default: %(default)s)"
    )
    parser.add_argument(
        "--port",
        type=number(int),
        default=8000,
        help="port to listen on: the one the InferencePool targets (default: %(default)s)",
    )
    parser.add_argument(
        "--vllm",
        type=http_url,
        default=f"http://127.0.0.1:{DEFAULT_PD_VLLM_PORT}",
        help="the local vLLM OpenAI server (default: %(default)s)",
    )
    parser.add_argument(
        "--key-file",
        type=Path,
        help="the pool's disaggregation key, which the endpoint picker signs prefill headers "
        "with (default: none: every request is served locally)",
    )
    parser.add_argument(
        "--node",
        default=os.environ.get(NODE_NAME_ENV, ""),
        help=f"this pod's node, where the prefill's agent pushes the prompt's chunks "
        f"(default: ${NODE_NAME_ENV}; none: the decode's agent pulls them)",
    )
    parser.add_argument(
        "--prefill-timeout-s",
        type=number(float),
        default=float(DEFAULT_PD_PREFILL_TIMEOUT_SECONDS),
        help="a prefill not answered within this many seconds is computed here instead "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--decode-wait-ms",
        type=number(int, zero=True, most=MAX_PD_DECODE_WAIT_MS),
        default=DEFAULT_PD_DECODE_WAIT_MS,
        help="how long the decode may wait for the prefill's chunks (default: %(default)s)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=number(int),
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body; a larger one is answered 413 (default: %(default)s)",
    )
    parser.add_argument(
        "--llmd-header-compat",
        action="store_true",
        help="also follow llm-d's unsigned x-prefiller-host-port header: unsafe unless a "
        "NetworkPolicy lets only the gateway reach this port",
    )
    parser.add_log_level()
    return parser


def settings(args: argparse.Namespace) -> SidecarSettings:
    """The settings of the parsed flags; ConfigError when the key file is unusable."""
    key = None
    if args.key_file is not None:
        try:
            key = read_key(args.key_file)
        except OSError as error:
            raise ConfigError([f"--key-file {args.key_file}: {error.strerror}"]) from error
        except ValueError as error:
            raise ConfigError([f"--key-file {error}"]) from error
    return SidecarSettings(
        vllm=args.vllm,
        key=key,
        node=args.node or None,
        prefill_timeout_s=args.prefill_timeout_s,
        decode_wait_ms=int(args.decode_wait_ms),
        llmd_header_compat=args.llmd_header_compat,
    )


async def serve(settings: SidecarSettings, host: str, port: int, limits: HttpLimits) -> None:
    """Serve until SIGTERM or SIGINT; ConfigError when the port cannot be bound."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    with listening("--port", host, port):
        listener = listen(host, port)
    client = httpx.AsyncClient(
        # no read timeout: a decode streams for as long as it generates
        timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
        limits=httpx.Limits(
            max_connections=None,
            max_keepalive_connections=limits.max_connections,
            # an idle connection goes before vLLM closes it (its keep-alive is 5 s): else a
            # request may go out on one the server is closing, and fail (a 502)
            keepalive_expiry=KEEPALIVE_S,
        ),
        trust_env=False,  # an HTTP_PROXY of the pod's must not take the local vLLM's traffic
    )
    app = BodyGate(Sidecar(settings, client), auth=None, limits=limits)
    async with client, serve_http(app, host, port, limits, listener=listener) as url:
        log.info(
            "%s serving on %s for %s: %s",
            PROG,
            url,
            settings.vllm,
            "disaggregating requests with a signed prefill header"
            if settings.key is not None
            else "no --key-file: pass-through only, prefill headers stripped",
        )
        await stopping.wait()
    log.info("%s stopped", PROG)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    start_logging(args.log_level)
    # httpx logs each request at INFO: a line per request of every client is an access
    # log, which the gateway keeps (with the result header), not the sidecar
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        chosen = settings(args)
        limits = HttpLimits(max_body_bytes=args.max_body_bytes)
        asyncio.run(serve(chosen, args.host, args.port, limits))
    except ConfigError as error:
        return exit_with(PROG, error)
    return 0
