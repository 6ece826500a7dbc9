"""``kvpool doctor``: check a deployment end to end, as a vLLM pod's connector sees it.

Prints one line per check, ``PASS|WARN|FAIL|SKIP  <check>  <what was seen>``, and under
a WARN or FAIL the fix; exits 1 if any check failed, else 0. With ``--json`` those lines go
to standard error as the checks run, and standard output gets one JSON object at the end:
``{"checks": [{"name", "outcome", "seen", "fix"}, ...], "failed": true|false}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import urllib.parse
from pathlib import Path
from typing import Any

from kvpool.common.names import (
    ADMIN_TOKEN_ENV,
    CONNECTOR_ENDPOINT_ENV,
    CONNECTOR_OLD_NAMES,
    CONNECTOR_TOKEN_ENV,
    CONNECTOR_TOKEN_FILE_ENV,
)
from kvpool.common.problems import ConfigError, exit_with, number, show
from kvpool.connector.identity import credential
from kvpool.connector.settings import ConnectorSettings
from kvpool.tools.doctor.fingerprint import EngineModel
from kvpool.tools.doctor.model import read_model_config
from kvpool.tools.doctor.report import Check, exit_code
from kvpool.tools.doctor.run import Options, diagnose

PROG = "kvpool doctor"


FLAGS = {
    "endpoint": "--endpoint",
    "pool": "--pool",
    "namespace": "--namespace",
    "segment_path": "--segment-path",
    "token_file": "--token-file",
}
"""The connector's settings that the doctor takes from its command line, and their flags."""


def _http_url(text: str) -> str:
    parsed = urllib.parse.urlsplit(text)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise argparse.ArgumentTypeError(f"expected http://HOST:PORT, not {text!r}")
    return text.rstrip("/")


def _grpc_address(text: str) -> str:
    host, colon, port = text.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, not {text!r}")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--endpoint", help="the agent's ZMQ address, tcp://HOST:PORT (no Kubernetes)"
    )
    target.add_argument(
        "--pool", help="the KVCachePool: check through its Service, as the connector"
    )
    parser.add_argument("--namespace", help="the pool's namespace; default: this pod's")
    parser.add_argument(
        "--segment-path",
        type=Path,
        help="where this pod sees the segment, if not where the Service says",
    )
    parser.add_argument(
        "--http", type=_http_url, help="the agent's HTTP API with --endpoint, http://HOST:PORT"
    )
    parser.add_argument(
        "--picker",
        type=_grpc_address,
        help="the endpoint picker's gRPC address, HOST:PORT, if not the index Service's "
        "(e.g. kubectl port-forward svc/kvpool-POOL-index 7405)",
    )
    parser.add_argument("--block-size", type=number(int), help="vLLM's block size (tokens)")
    parser.add_argument(
        "--model", help="the model in the key fingerprint, as the connector logs it"
    )
    parser.add_argument("--dtype", help="the KV cache dtype, as the connector logs it")
    parser.add_argument("--kv-layout", help="the KV layout, as the connector logs it")
    parser.add_argument(
        "--tp-size", type=number(int), default=1, help="tensor-parallel size (default 1)"
    )
    parser.add_argument(
        "--model-config",
        type=Path,
        help="the model's directory or its config.json: what kvpool caches of each kind of "
        "layer (read alone: no agent needed)",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        help=f"a file holding the token the connector uses (or set {CONNECTOR_TOKEN_ENV} or "
        f"{CONNECTOR_TOKEN_FILE_ENV}, as for the connector)",
    )
    parser.add_argument(
        "--admin-token-file",
        type=Path,
        help=f"a file holding an admin token of the pool (or set {ADMIN_TOKEN_ENV})",
    )
    parser.add_argument(
        "--min-lookups",
        type=number(int),
        default=100,
        help="chunk lookups without a hit that flag a tenant (default 100)",
    )
    parser.add_argument(
        "--timeout", type=number(float), default=3.0, help="seconds per request (default 3)"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the result as one JSON object on standard output (each check's lines go "
        "to standard error as it runs)",
    )


def run(args: argparse.Namespace) -> int:
    extra_config: dict[str, Any] = (
        {"endpoint": args.endpoint}
        if args.endpoint is not None
        else {"pool": args.pool, "namespace": args.namespace}
    )
    if args.segment_path is not None:
        extra_config["segment_path"] = args.segment_path
    if args.token_file is not None:
        extra_config["token_file"] = args.token_file
    # --pool asks for the pool's Service to be checked: it wins over a
    # KVPOOL_CONNECTOR_ENDPOINT (or its old name) that kvpool's admission webhook put in the
    # pod (the other overrides, such as the segment's path in the pod, still apply)
    endpoint = (CONNECTOR_ENDPOINT_ENV, CONNECTOR_OLD_NAMES[CONNECTOR_ENDPOINT_ENV])
    environ = {
        name: value
        for name, value in os.environ.items()
        if args.endpoint is not None or name not in endpoint
    }
    try:
        settings = ConnectorSettings.load(extra_config, environ, flags=FLAGS)
        admin_token = _admin_token(args.admin_token_file)
        model_config = None if args.model_config is None else read_model_config(args.model_config)
    except ConfigError as error:
        return exit_with(PROG, error)
    options = Options(
        settings=settings,
        credential=credential(settings, environ),
        http_url=args.http,
        picker=args.picker,
        admin_token=admin_token,
        block_size=args.block_size,
        engine=EngineModel(args.model, args.dtype, args.kv_layout, args.tp_size),
        min_lookups=args.min_lookups,
        model_config=model_config,
        timeout=args.timeout,
    )
    checks: list[Check] = []
    for check in diagnose(options):
        checks.append(check)
        print("\n".join(check.lines()), file=sys.stderr if args.json else sys.stdout, flush=True)
    code = exit_code(checks)
    if args.json:
        print(json.dumps({"checks": [dataclasses.asdict(c) for c in checks], "failed": code == 1}))
    return code


def _admin_token(path: Path | None) -> str | None:
    if path is not None:
        try:
            return path.read_text().strip()
        except OSError as error:
            raise ConfigError(
                [f"--admin-token-file {show(path)}: cannot read it: {error.strerror}"]
            ) from None
    return os.environ.get(ADMIN_TOKEN_ENV) or None
