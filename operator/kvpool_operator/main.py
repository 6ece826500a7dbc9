"""``kvpool-operator``: run the operator (kopf) for some namespaces or the whole cluster.

Before kopf starts, what kopf would only log (a traceback, then retries forever) is refused
in one line, exit 2: no Kubernetes credentials at all, and a liveness port that cannot be
bound. An API server that is configured but unreachable is not refused: kopf retries.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import urllib.parse
from collections.abc import Sequence

import kopf
import yaml
from kubernetes.config import ConfigException

from kvpool_agent import __version__
from kvpool_agent.config import yaml_problem
from kvpool_agent.kube.watch import api_configuration
from kvpool_agent.names import OPERATOR_AGENT_IMAGE_ENV
from kvpool_agent.problems import ArgumentParser, ConfigError, exit_with, listening, number, show
from kvpool_operator.handlers import registry
from kvpool_operator.reconcile import Options


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


def check_credentials() -> None:
    """Some Kubernetes credentials are there, as kopf's login and ``Cluster.connect`` read
    them: in a pod its service account, else the kubeconfig. Nothing is asked of the API
    server. :class:`ConfigError` naming where they were looked for."""
    try:
        api_configuration()
    except (ConfigException, yaml.YAMLError, OSError) as error:
        problem = f"{_credentials_source()}: no Kubernetes credentials: {_why(error)}"
        raise ConfigError([problem]) from error


def _credentials_source() -> str:
    if "KUBERNETES_SERVICE_HOST" in os.environ:
        host = os.environ["KUBERNETES_SERVICE_HOST"]
        return f"in-cluster service account (KUBERNETES_SERVICE_HOST={show(host)})"
    if "KUBECONFIG" in os.environ:
        return f"KUBECONFIG={show(os.environ['KUBECONFIG'])}"
    return "KUBECONFIG (not set: ~/.kube/config)"


def _why(error: Exception) -> str:
    if isinstance(error, yaml.YAMLError):
        return f"not YAML: {yaml_problem(error)}"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return " ".join(str(error).split())


def check_liveness(url: str) -> None:
    """The liveness endpoint's port can be bound (then let go, for kopf to bind):
    :class:`ConfigError` naming ``--liveness`` if not."""
    parsed = urllib.parse.urlsplit(url)
    host, port = parsed.hostname or "", parsed.port or 0
    with listening("--liveness", host, port):
        socket.create_server((host, port)).close()


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
        help="period of each KVCacheTenant's re-check and usage read (default: %(default)s)",
    )
    parser.add_argument(
        "--clear-retries",
        type=number(int, zero=True),
        default=5,
        help="retries of a deleted KVCacheTenant's clearing while agents fail, before it is "
        "deleted anyway (default: %(default)s)",
    )
    parser.add_argument("--log-format", choices=["json", "plain"], default="json")
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    if not args.agent_image:
        parser.error(f"--agent-image or ${OPERATOR_AGENT_IMAGE_ENV} is required")
    try:
        check_credentials()
        check_liveness(args.liveness)
    except ConfigError as error:
        return exit_with(parser.prog, error)
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
