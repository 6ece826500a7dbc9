"""``kvpool-operator``: run the operator (kopf) for some namespaces or the whole cluster.

Before kopf starts, what kopf would only log (a traceback, then retries forever) is refused
in one line, exit 2: no Kubernetes credentials at all, a liveness or webhook port that
cannot be bound, a webhook certificate directory without its files. An API server that is
configured but unreachable is not refused: kopf retries.

The admission webhook (:mod:`kvpool.operator.admission`) is off unless a way to reach it is
given: ``--webhook-url-host`` or ``--webhook-service``.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import socket
import sys
import urllib.parse
from collections.abc import Sequence
from pathlib import Path

import kopf

from kvpool import __version__
from kvpool.common.kube.watch import checked_api_configuration
from kvpool.common.names import OPERATOR_AGENT_IMAGE_ENV
from kvpool.common.problems import ArgumentParser, ConfigError, exit_with, listening, number
from kvpool.operator.admission import certificates
from kvpool.operator.admission.handlers import register as register_webhook
from kvpool.operator.admission.server import (
    DEFAULT_CONFIGURATION,
    DEFAULT_PORT,
    ServiceRef,
    WebhookOptions,
)
from kvpool.operator.handlers import registry
from kvpool.operator.reconcile import Options


def _liveness(text: str) -> str:
    """kopf's liveness endpoint: ``http://HOST:PORT/PATH``."""
    parsed = urllib.parse.urlsplit(text)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme != "http" or not parsed.hostname or port is None:
        raise argparse.ArgumentTypeError(f"expected http://HOST:PORT/PATH, not {text!r}")
    return text


_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_HOST = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?")


def _service(text: str) -> tuple[str, str]:
    """``--webhook-service``: ``NAMESPACE/NAME``, each a DNS label."""
    namespace, _, name = text.partition("/")
    if not (_DNS_LABEL.fullmatch(namespace) and _DNS_LABEL.fullmatch(name)):
        raise argparse.ArgumentTypeError(f"expected NAMESPACE/NAME, not {text!r}")
    return namespace, name


def _host(text: str) -> str:
    """``--webhook-url-host``: a host name or an IP address (no scheme, port or path)."""
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        pass
    if len(text) > 253 or not _HOST.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected a host name or an IP address, not {text!r}")
    return text


def _configuration(text: str) -> str:
    """``--webhook-configuration``: a DNS subdomain of two labels or more (the webhook's
    name, ``cache-pool.<it>``, must have three)."""
    labels = text.split(".")
    if len(text) > 200 or len(labels) < 2 or not all(map(_DNS_LABEL.fullmatch, labels)):
        raise argparse.ArgumentTypeError(
            f"expected a DNS name with a dot (e.g. {DEFAULT_CONFIGURATION}), not {text!r}"
        )
    return text


def _port(text: str) -> int:
    port = int(number(int)(text))
    if port > 65535:
        raise argparse.ArgumentTypeError(f"expected a port (1 to 65535), not {text}")
    return port


def check_liveness(url: str) -> None:
    """The liveness endpoint's port can be bound (then let go, for kopf to bind):
    :class:`ConfigError` naming ``--liveness`` if not."""
    parsed = urllib.parse.urlsplit(url)
    host, port = parsed.hostname or "", parsed.port or 0
    with listening("--liveness", host, port):
        socket.create_server((host, port)).close()


def check_webhook(options: WebhookOptions) -> None:
    """The webhook's port can be bound and its certificate directory has its files:
    :class:`ConfigError` naming the flag if not."""
    if options.cert_dir is not None and (problem := certificates.problem(options.cert_dir)):
        raise ConfigError([f"--webhook-cert-dir {problem}"])
    with listening("--webhook-port", options.bind, options.port):
        socket.create_server((options.bind, options.port)).close()


def _webhook_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "admission webhook",
        "Wire the pods labelled kvpool.io/cache-pool to their tenant's pool. Off unless "
        "--webhook-url-host or --webhook-service says how the API server reaches it.",
    )
    reach = group.add_mutually_exclusive_group()
    reach.add_argument(
        "--webhook-url-host",
        type=_host,
        metavar="HOST",
        help="serve the webhook; the API server calls https://HOST:PORT/ (out of the cluster)",
    )
    reach.add_argument(
        "--webhook-service",
        type=_service,
        metavar="NAMESPACE/NAME",
        help="serve the webhook; the API server calls it through this Service (in the cluster)",
    )
    group.add_argument(
        "--webhook-service-port",
        type=_port,
        metavar="PORT",
        help="the Service's port (default: 443)",
    )
    group.add_argument(
        "--webhook-port",
        type=_port,
        metavar="PORT",
        help=f"port the webhook listens on (default: {DEFAULT_PORT})",
    )
    group.add_argument(
        "--webhook-bind",
        metavar="ADDRESS",
        help="address the webhook listens on (default: 0.0.0.0)",
    )
    group.add_argument(
        "--webhook-cert-dir",
        type=Path,
        metavar="DIR",
        help="serve tls.crt and tls.key of DIR, publish its ca.crt (cert-manager's files); "
        "default: a CA and a certificate made at start",
    )
    group.add_argument(
        "--webhook-configuration",
        type=_configuration,
        metavar="NAME",
        help="the MutatingWebhookConfiguration the operator keeps "
        f"(default: {DEFAULT_CONFIGURATION})",
    )


def _webhook(parser: argparse.ArgumentParser, args: argparse.Namespace) -> WebhookOptions | None:
    """The webhook's options, or None when it is off; refuses its flags without it."""
    if args.webhook_url_host is None and args.webhook_service is None:
        given = [
            flag
            for flag in ("service_port", "port", "bind", "cert_dir", "configuration")
            if getattr(args, f"webhook_{flag}") is not None
        ]
        if given:
            flag = "--webhook-" + given[0].replace("_", "-")
            parser.error(f"{flag} needs --webhook-url-host or --webhook-service")
        return None
    if args.webhook_service_port is not None and args.webhook_service is None:
        parser.error("--webhook-service-port needs --webhook-service")
    service = None
    if args.webhook_service is not None:
        namespace, name = args.webhook_service
        service = ServiceRef(namespace, name, args.webhook_service_port or 443)
    return WebhookOptions(
        bind=args.webhook_bind or "0.0.0.0",
        port=args.webhook_port or DEFAULT_PORT,
        url_host=args.webhook_url_host,
        service=service,
        cert_dir=args.webhook_cert_dir,
        configuration=args.webhook_configuration or DEFAULT_CONFIGURATION,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="kvpool-operator",
        description="Reconcile KVCachePool resources into DaemonSets of kvpool agents.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "-n", "--namespace", action="append", help="serve this namespace (repeatable)"
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="serve every namespace")
    parser.add_argument(
        "--agent-image",
        default=os.environ.get(OPERATOR_AGENT_IMAGE_ENV),
        help=f"image of agents whose pool names none (default: ${OPERATOR_AGENT_IMAGE_ENV})",
    )
    parser.add_argument(
        "--liveness",
        type=_liveness,
        default="http://0.0.0.0:8080/healthz",
        help="liveness endpoint to serve (default: %(default)s)",
    )
    parser.add_argument(
        "--retry-seconds",
        type=number(float),
        default=10.0,
        help="delay before retrying a pool whose children the API server refused "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--usage-seconds",
        type=number(float),
        default=30.0,
        help="period of each KVCacheTenant's re-check and usage read, of each pool's shared "
        "spaces pass and of its peer key rotation check (default: %(default)s)",
    )
    parser.add_argument(
        "--clear-retries",
        type=number(int, zero=True),
        default=5,
        help="retries of a deleted KVCacheTenant's clearing while agents fail, before it is "
        "deleted anyway (default: %(default)s)",
    )
    _webhook_flags(parser)
    parser.add_argument("--log-format", choices=["json", "plain"], default="json")
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    if not args.agent_image:
        parser.error(f"--agent-image or ${OPERATOR_AGENT_IMAGE_ENV} is required")
    webhook = _webhook(parser, args)
    try:
        checked_api_configuration()  # credentials, as kopf's login reads them
        check_liveness(args.liveness)
        if webhook is not None:
            check_webhook(webhook)
    except ConfigError as error:
        return exit_with(parser.prog, error)
    if webhook is not None:
        register_webhook(registry, webhook)
    kopf.configure(
        verbose=args.verbose,
        log_format=kopf.LogFormat.JSON if args.log_format == "json" else kopf.LogFormat.FULL,
    )
    kopf.run(
        registry=registry,
        clusterwide=args.all_namespaces,
        namespaces=args.namespace or (),
        liveness_endpoint=args.liveness,
        standalone=True,
        memo=kopf.Memo(
            options=Options(
                agent_image=args.agent_image,
                retry_seconds=args.retry_seconds,
                usage_seconds=args.usage_seconds,
                clear_retries=args.clear_retries,
            )
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
