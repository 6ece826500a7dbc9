"""How much a big request body without a token grows a real agent's memory.

    .venv/bin/python -m tests.agent.web.body_memory --megabytes 400

starts an agent, sends ``PUT /v1/tenants/<id>/quota`` with a body of that size and no
token, and prints the agent's peak resident memory (VmHWM) before and after.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
from pathlib import Path

from kvpool.common.keys import tenant_id
from tests.support.agent_process import AgentProcess
from tests.support.raw_http import Answer, connect, head, read_answer

QUOTA_PATH = f"/v1/tenants/{tenant_id('alice')}/quota"


def send_unauthenticated_body(url: str, size: int) -> Answer:
    """Send the whole body (as far as the agent takes it) and return its answer."""
    with connect(url, timeout=30) as sock:
        sock.sendall(
            head(
                "PUT", QUOTA_PATH, {"Content-Type": "application/json", "Content-Length": str(size)}
            )
        )

        def upload() -> None:
            block = b" " * (1 << 20)
            try:
                for _ in range(size // len(block)):
                    sock.sendall(block)
                sock.sendall(b" " * (size % len(block)))
            except OSError:  # the agent closed the connection: it wants no more
                pass

        sender = threading.Thread(target=upload, daemon=True)
        sender.start()
        answer = read_answer(sock)
        sender.join(60)
        return answer


def body_memory_growth(agent: AgentProcess, size: int) -> tuple[Answer, int]:
    """The answer to an unauthenticated body of ``size`` bytes, and the agent's peak RSS growth."""
    before = agent.memory_bytes("VmHWM")
    answer = send_unauthenticated_body(agent.http, size)
    return answer, agent.memory_bytes("VmHWM") - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=int, default=400)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        agent = AgentProcess(Path(workdir)).start()
        try:
            answer, growth = body_memory_growth(agent, args.megabytes * 1_000_000)
        finally:
            agent.cleanup()
    growth_mib = growth / 2**20
    print(
        f"{args.megabytes} MB body, no token: HTTP {answer.status}, peak RSS +{growth_mib:.1f} MiB"
    )


if __name__ == "__main__":
    main()
