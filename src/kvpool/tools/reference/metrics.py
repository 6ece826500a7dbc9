"""The metrics page: every family the agent's and the index's ``/metrics`` show, and the
connector's counters in vLLM's ``/metrics``.

The agent's families are read from a real agent (an NVMe tier and a peer configured, so that
their families show), started for the page on free ports in a temporary directory, sent a
store and a retrieve for one tenant (so that the per-tenant and per-operation families show
their labels), and stopped after one scrape; the index's from its metrics registry, built
in-process with one node followed; the connector's from
:data:`~kvpool.connector.counters.COUNTERS`.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from kvpool.client import AgentClient
from kvpool.common.keys import ModelFingerprint, chunk_keys, tenant_id
from kvpool.common.kube.discovery import AgentEndpoint
from kvpool.common.web.connections import HttpRefusals
from kvpool.connector.counters import COUNTERS
from kvpool.index.metrics import IndexMetrics
from kvpool.index.subscriber import AgentStatus
from kvpool.index.tracker import PrefixTracker
from kvpool.tools.reference.commands import script

_READY = re.compile(r"agent ready .* zmq=(\S+) http=(\S+)")


@dataclass
class Family:
    name: str
    kind: str
    help: str
    labels: set[str] = field(default_factory=set)

    def row(self) -> str:
        counter = self.kind == "counter" and not self.name.endswith("_total")
        name = f"{self.name}_total" if counter else self.name
        labels = ", ".join(f"`{label}`" for label in sorted(self.labels))
        meaning = " ".join(self.help.split()).replace("|", "\\|")
        return f"| `{name}` | {self.kind} | {labels} | {meaning} |"


def families(text: str) -> list[Family]:
    """The families of a Prometheus text exposition, with the label names of their samples."""
    found: dict[str, Family] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, meaning = line[7:].partition(" ")
            found[name] = Family(name, "untyped", meaning.replace("\\n", " ").replace("\\\\", "\\"))
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            found[name].kind = kind
        elif line and not line.startswith("#"):
            sample = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?", line)
            assert sample is not None, line
            owner = _owner(sample[1], found)
            if owner is not None and sample[3]:
                owner.labels |= {
                    label for label in re.findall(r'([a-zA-Z_]+)="', sample[3]) if label != "le"
                }
    created = [
        name
        for name in found
        if name.endswith("_created") and {name[:-8], name[:-8] + "_total"} & found.keys()
    ]
    return sorted(
        (family for name, family in found.items() if name not in created),
        key=lambda family: family.name,
    )


def _owner(sample: str, found: dict[str, Family]) -> Family | None:
    for suffix in ("", "_total", "_created", "_bucket", "_count", "_sum"):
        if suffix and sample.endswith(suffix) and sample[: -len(suffix)] in found:
            return found[sample[: -len(suffix)]]
        if not suffix and sample in found:
            return found[sample]
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def agent_exposition(timeout: float = 60.0) -> str:
    """One scrape of a real agent with an NVMe tier and a (silent) peer."""
    with tempfile.TemporaryDirectory(prefix="kvpool-reference-") as workdir:
        root = Path(workdir)
        keys = root / "peer-keys"
        keys.mkdir(mode=0o700)
        (keys / "1").write_text(secrets.token_hex(32))
        (keys / "1").chmod(0o600)
        settings = {
            "POOL": "reference",
            "SEGMENT_PATH": str(root / "shm" / "segment"),
            "L1_SIZE": "16Mi",
            "ZMQ_PORT": "0",
            "HTTP_PORT": "0",
            "EVENTS_PORT": "0",
            "STATE_DIR": str(root / "state"),
            "NVME": json.dumps({"path": str(root / "nvme"), "capacity": "64Mi"}),
            "PEERS": json.dumps(
                {
                    "port": _free_port(),
                    "key_dir": str(keys),
                    "node": "node-a",
                    "agents": [f"node-b=127.0.0.1:{_free_port()}"],
                }
            ),
        }
        environment = {
            **{name: value for name, value in os.environ.items() if not name.startswith("KVPOOL_")},
            **{f"KVPOOL_{name}": value for name, value in settings.items()},
        }
        process = subprocess.Popen(
            script("kvpool-agent"),
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            zmq, http = _wait_ready(process, timeout)
            _traffic(zmq, (root / "state" / "engine-token-reference").read_text().strip())
            return _scrape_after_writeback(f"{http}/metrics", timeout)
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _traffic(endpoint: str, token: str) -> None:
    """A store and a retrieve of two chunks for one tenant."""
    tenant = tenant_id("reference")
    model = ModelFingerprint("reference", "bfloat16", "nhd", chunk_tokens=4)
    keys = chunk_keys(list(range(8)), "reference", model)
    with AgentClient(endpoint, token=token) as client:
        client.store_inline(tenant, keys, [b"first chunk", b"second chunk"])
        client.retrieve_inline(tenant, keys)


def _scrape_after_writeback(url: str, timeout: float) -> str:
    """The exposition once the stored chunks' write-back to NVMe shows (so that the page
    does not depend on whether it finished first)."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            text = str(answer.read().decode())
        if "kvpool_l2_seconds_count{" in text:
            return text
        if time.monotonic() > deadline:
            raise RuntimeError("the agent wrote nothing back to its NVMe tier in time")
        time.sleep(0.1)


def _wait_ready(process: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    found: list[tuple[str, str]] = []
    log: list[str] = []

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            log.append(line)
            ready = _READY.search(line)
            if ready and not found:
                found.append((ready[1], ready[2]))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while not found and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)
    if not found:
        raise RuntimeError("the agent did not start:\n" + "".join(log[-20:]))
    return found[0]


def index_exposition() -> str:
    """The index's metrics, following one node that sent one event, after one route."""
    node = AgentEndpoint("node-a", "tcp://127.0.0.1:7400", "tcp://127.0.0.1:7402")
    status = AgentStatus(
        endpoint=node,
        agent_id="reference",
        seq=1,
        synced=True,
        connected=True,
        events=1,
        resyncs={"connected": 1},
        snapshot_failures=0,
        last_event=0.0,
        event_lag=0.0,
    )
    tracker = PrefixTracker()
    tracker.stored(node.node, [bytes(32)])
    registry = CollectorRegistry()
    metrics = IndexMetrics(registry, tracker, lambda: [status], clock=lambda: 0.0)
    metrics.register_http(HttpRefusals())
    metrics.observe_query("route", 0.001)
    return generate_latest(registry).decode()


def _table(rows: Iterator[str]) -> str:
    return "\n".join(["| metric | type | labels | meaning |", "| --- | --- | --- | --- |", *rows])


def render() -> str:
    agent = [
        family for family in families(agent_exposition()) if not family.name.startswith("python_")
    ]
    index = families(index_exposition())
    connector = (
        f"| `vllm:kvpool_{name}_total` | counter | | {' '.join(meaning.split())} |"
        for name, meaning in COUNTERS.items()
    )
    return "\n".join(
        [
            "Labels: those of the samples a freshly started agent (an NVMe tier and one peer, "
            "no tenant yet) and a fresh index show; a family with no sample yet shows none "
            'here (its meaning names them: "by tier", "by reason").',
            "",
            "## The agent (`kvpool-agent`, `GET /metrics` on `http_port`)",
            "",
            _table(family.row() for family in agent),
            "",
            "## The prefix index (`kvpool-index`, `GET /metrics`)",
            "",
            _table(family.row() for family in index),
            "",
            "## The vLLM connector (vLLM's own `/metrics`)",
            "",
            _table(connector),
        ]
    )
