"""``kvpool-csi``: the CSI node plugin that publishes a pool's segment directory into pods.

It serves the CSI Identity and Node services on ``--endpoint`` and, with
``--registration-dir``, the kubelet's plugin registration beside them. Without Kubernetes
credentials or a node id it stops in one line (exit 2); SIGTERM stops it, its sockets
removed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from kubernetes.client import ApiClient, CoreV1Api

from kvpool import __version__
from kvpool.common.kube.watch import checked_api_configuration
from kvpool.common.names import CSI_DRIVER, NODE_NAME_ENV, SHM_DIR
from kvpool.common.problems import (
    ArgumentParser,
    ConfigError,
    exit_with,
    number,
    start_logging,
)
from kvpool.csi.identity import identity
from kvpool.csi.node import Node, NodeOptions
from kvpool.csi.registration import registration, registration_socket
from kvpool.csi.rpc import serve, stop

log = logging.getLogger(__name__)

PROG = "kvpool-csi"

DEFAULT_KUBELET_DIR = Path("/var/lib/kubelet")
DEFAULT_KUBELET_ENDPOINT = DEFAULT_KUBELET_DIR / "plugins" / CSI_DRIVER / "csi.sock"
GRACE_SECONDS = 5.0


def unix_socket(text: str) -> Path:
    """``unix:///path/to/socket``: the socket's absolute path."""
    path = text.removeprefix("unix://")
    if path == text or not path.startswith("/"):
        raise argparse.ArgumentTypeError(f"expected unix:///ABSOLUTE/PATH, not {text!r}")
    return Path(path)


def absolute(text: str) -> Path:
    if not text.startswith("/"):
        raise argparse.ArgumentTypeError(f"expected an absolute path, not {text!r}")
    return Path(text)


def parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog=PROG, description=f"The CSI node plugin {CSI_DRIVER}: a pool's segment in pods."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--endpoint",
        type=unix_socket,
        default=unix_socket("unix:///csi/csi.sock"),
        help="the CSI socket to serve, as this container sees it (default: unix:///csi/csi.sock)",
    )
    parser.add_argument(
        "--registration-dir",
        type=absolute,
        help=f"the kubelet's plugin registration directory, as this container sees it: "
        f"serves {CSI_DRIVER}-reg.sock there (default: no registration)",
    )
    parser.add_argument(
        "--kubelet-endpoint",
        type=absolute,
        default=DEFAULT_KUBELET_ENDPOINT,
        help="the CSI socket's path as the kubelet sees it, for the registration "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--kubelet-dir",
        type=absolute,
        default=DEFAULT_KUBELET_DIR,
        help="the kubelet's root directory, as this container sees it: targets must lie "
        "in its pods/ (default: %(default)s)",
    )
    parser.add_argument(
        "--shm-dir",
        type=absolute,
        default=SHM_DIR,
        help="the node's shared memory, as this container sees it: a pool's directory "
        "must be one of its entries (default: %(default)s)",
    )
    parser.add_argument(
        "--node-id",
        default=os.environ.get(NODE_NAME_ENV, ""),
        help=f"this node's name, for NodeGetInfo (default: ${NODE_NAME_ENV})",
    )
    parser.add_argument(
        "--api-timeout",
        type=number(float),
        default=5.0,
        help="timeout of each read of the Kubernetes API, in seconds (default: %(default)s)",
    )
    parser.add_log_level()
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = parser()
    args = arguments.parse_args(argv)
    if not args.node_id:
        arguments.error(f"--node-id or ${NODE_NAME_ENV} is required")
    try:
        configuration = checked_api_configuration()
    except ConfigError as error:
        return exit_with(PROG, error)
    start_logging(args.log_level)
    api = CoreV1Api(ApiClient(configuration))
    node = Node(
        NodeOptions(
            node_id=args.node_id,
            kubelet_dir=args.kubelet_dir,
            shm_dir=args.shm_dir,
            api=lambda: api,
            api_timeout=args.api_timeout,
        )
    )
    stopping = threading.Event()

    def on_signal(number: int, _frame: FrameType | None) -> None:
        log.info("%s: stopping", signal.Signals(number).name)
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    servers = []
    try:
        servers.append((serve(args.endpoint, [identity(), node.handler()]), args.endpoint))
        if args.registration_dir is not None:
            socket = registration_socket(args.registration_dir)
            handler = registration(str(args.kubelet_endpoint))
            servers.append((serve(socket, [handler]), socket))
    except RuntimeError as error:  # a socket that cannot be bound
        print(f"{PROG}: cannot serve: {error}", file=sys.stderr)
        for server, socket in servers:
            stop(server, socket, 0)
        return 1
    log.info(
        "csi plugin ready driver=%s node=%s endpoint=%s registration=%s",
        CSI_DRIVER,
        args.node_id,
        args.endpoint,
        servers[1][1] if len(servers) > 1 else "none",
    )
    stopping.wait()
    for server, socket in reversed(servers):
        stop(server, socket, GRACE_SECONDS)
    log.info("csi plugin stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
