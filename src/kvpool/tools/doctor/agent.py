"""The agent check: the agent answers hello at the address the connector would use, and
takes the token the connector would send.

When it does not, a plain TCP connection to the same address tells why: the name does not
resolve, nothing listens on the port, or something that is not an agent listens there.
"""

from __future__ import annotations

import socket

import zmq

from kvpool.client import AgentClient, AgentError, AgentUnavailable
from kvpool.common.names import CONNECTOR_TOKEN_ENV
from kvpool.common.protocol import PROTOCOL_VERSION, ErrorCode
from kvpool.connector.identity import Credential, CredentialMissing
from kvpool.tools.doctor.report import Check, failed, passed, size

NAME = "agent"
CLIENT_NAME = "kvpool-doctor"


def reach(
    endpoint: str, credential: Credential, timeout: float, pool: str | None
) -> tuple[Check, AgentClient | None]:
    """Say hello to the agent; the connected client if it answered."""
    try:
        token = credential()
    except CredentialMissing as error:
        return failed(NAME, str(error), _TOKEN_FIX), None
    client = AgentClient(endpoint, token=token, client_name=CLIENT_NAME, timeout=timeout)
    try:
        info = client.connect()
    except AgentUnavailable:
        client.close()
        return failed(NAME, _silence(endpoint, timeout), _where_agents_run(pool)), None
    except AgentError as error:
        client.close()
        if error.code == ErrorCode.UNSUPPORTED_VERSION:
            return failed(
                NAME,
                f"protocol mismatch: the agent at {endpoint} refuses protocol "
                f"{PROTOCOL_VERSION}: {error}",
                "run one kvpool release in the vLLM image and in the agents (upgrade the "
                "older side): the protocol version is part of the release",
            ), None
        if error.code in (ErrorCode.UNAUTHENTICATED, ErrorCode.FORBIDDEN):
            return failed(
                NAME, f"the agent at {endpoint} refused the token: {error}", _TOKEN_FIX
            ), None
        return failed(NAME, f"the agent at {endpoint} refused hello: {error}", _LOGS), None
    except zmq.ZMQError as error:
        client.close()
        return failed(NAME, f"cannot connect to {endpoint}: {error}", _ENDPOINT_FORM), None
    return passed(
        NAME,
        f"{endpoint} answers hello: agent {info.agent_id}, protocol {PROTOCOL_VERSION}, "
        f"segment {info.segment_path} ({size(info.data_size)} of chunk data)",
    ), client


_TOKEN_FIX = (
    "give the connector (and the doctor) a token of the pool: a team's engine takes its "
    f"KVCacheTenant's Secret (key 'token') as {CONNECTOR_TOKEN_ENV}; a shared engine an "
    "engine token of "
    "the pool's tokens file; on the embedded default, the agent writes one to "
    "~/.local/state/kvpool/engine-token-<pool>"
)
_LOGS = "the agent's log says why (kubectl logs, or the kvpool-agent process's stderr)"
_ENDPOINT_FORM = "an endpoint is tcp://HOST:PORT or ipc://PATH"


def _silence(endpoint: str, timeout: float) -> str:
    """Why an endpoint did not answer, as far as a TCP connection can tell."""
    silent = f"no answer from {endpoint} in {timeout:g} s"
    if not endpoint.startswith("tcp://"):
        return silent
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return (
                f"{silent}: {host}:{port} accepts connections but does not speak the kvpool "
                "protocol (another server on that port, such as the agent's HTTP port?)"
            )
    except socket.gaierror:
        return f"{silent}: the name {host} does not resolve"
    except ConnectionRefusedError:
        return f"{silent}: nothing listens on {host}:{port} (connection refused): wrong port?"
    except (OSError, ValueError) as error:
        return f"{silent}: {host}:{port}: {error}"


def _where_agents_run(pool: str | None) -> str:
    if pool is None:
        return (
            "use the address the agent logs when ready ('agent ready ... zmq=tcp://HOST:PORT'), "
            "and check that the agent runs"
        )
    return (
        f"the pool's agent must run and be ready on this node (kubectl get pods -o wide "
        f"-l kvpool.io/pool={pool}: its DaemonSet's nodeSelector and tolerations must admit "
        "this node), and the Service's kvpool.io/zmq-port must be the agents' ZMQ port "
        "(spec.ports.zmq); the name resolves only inside the cluster"
    )
