"""The agent's round trips one at a time, from an idle client: RTT and the agent's own time.

The standalone reference for ``profile_connector_hit.py`` (whose round trips run inside a
busy engine): ping, the scheduler's unlocked lookup, the worker's locked lookup + release,
the no-op ``prepare_store`` a hit made for its one computed chunk, and the scheduler's probe of
the agent's table of ready chunks that replaces the unlocked lookup.

    .venv/bin/python benchmarks/profile_agent_ops.py
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import profile_connector_hit as hit
from kvpool.client import AgentClient
from kvpool.common import keys
from kvpool.common.probe_table import ProbeTableReader, table_path
from kvpool.tools.bench.local.agent_process import ADMIN_TOKEN, running_agent

CHUNK_BYTES = 524288  # the bench model's 128-token chunk


def main() -> None:
    with running_agent({"POOL": "bench", "L1_SIZE": "2GiB"}) as agent:
        hit.AGENT["http"] = agent.http
        client = AgentClient(agent.zmq, token=ADMIN_TOKEN, client_name="profile", timeout=5)
        client.connect()
        tenant = keys.tenant_id(None)
        chain = [hashlib.sha256(bytes([i])).digest() for i in range(16)]
        plan = client.prepare_store(tenant, chain, [CHUNK_BYTES] * 16, None)
        assert plan.lease is not None
        client.commit_store(plan.lease)

        def locked() -> None:
            found = client.lookup(tenant, chain[:15], lock=True, count=False)
            assert found.lease is not None
            client.release(found.lease)

        def measure(name: str, operation: Callable[[], object], n: int = 300) -> None:
            before, times = hit.agent_request_seconds(), []
            for _ in range(n):
                started = time.perf_counter()
                operation()
                times.append(time.perf_counter() - started)
            after = hit.agent_request_seconds()
            own = []
            for op, (seconds, count) in after.items():
                done = count - before.get(op, (0.0, 0.0))[1]
                if done:
                    spent = seconds - before.get(op, (0.0, 0.0))[0]
                    own.append(f"{op} {spent / done * 1e6:.0f} us")
            print(
                f"{name:34s} RTT p50 {statistics.median(times) * 1e6:6.0f} us, "
                f"agent-side {', '.join(own)}"
            )

        measure("ping", client.ping)
        measure(
            "lookup 15 keys, unlocked",
            lambda: client.lookup(tenant, chain[:15], lock=False, count=False),
        )
        measure("lookup 15 keys, locked + release", locked)
        measure(
            "prepare_store of 1 present chunk",
            lambda: client.prepare_store(tenant, chain[15:], [CHUNK_BYTES], chain[14]),
        )
        assert client.info is not None
        table = ProbeTableReader(table_path(client.info.segment_path), client.info.agent_id)
        measure(
            "table probe 15 keys (no round trip)",
            lambda: table.is_kept() and table.run(tenant, chain[:15]),
            n=3000,
        )
        table.close()
        client.close()


if __name__ == "__main__":
    main()
