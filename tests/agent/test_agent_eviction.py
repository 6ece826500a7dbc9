"""Eviction seen through a real agent process: a long prompt stored over several steps."""

from __future__ import annotations

import random
import time

import pytest

from kvpool.client import AgentClient
from kvpool.common.keys import tenant_id
from tests.support.agent_process import ADMIN_TOKEN, AgentProcess
from tests.support.chunks import key

pytestmark = pytest.mark.process

TENANT = tenant_id("salt-a")
PAGE = 64 << 10  # the agent's default page size
L1_PAGES = 128
LOW_PAGES = int(L1_PAGES * 0.80)  # the default low watermark


def test_a_prompt_longer_than_l1_keeps_the_longest_prefix_that_fits(
    agent_process: AgentProcess,
) -> None:
    """160 one-page chunks, 16 a step (chunked prefill), each step naming its parent."""
    agent_process.settings |= {
        "L1_SIZE": str(L1_PAGES * PAGE),
        "MAINTENANCE_INTERVAL_SECONDS": "0.2",
    }
    agent = agent_process.start()
    chain = [key(n) for n in range(160)]
    with AgentClient(agent.zmq, token=ADMIN_TOKEN) as client:
        for first in range(0, len(chain), 16):
            step = chain[first : first + 16]
            data = [random.Random(first + i).randbytes(PAGE) for i in range(len(step))]
            client.store(TENANT, step, data, chain[first - 1] if first else None)
        deadline = time.monotonic() + 10
        while client.stats()["allocated_bytes"] > LOW_PAGES * PAGE:  # the periodic check
            assert time.monotonic() < deadline, client.stats()
            time.sleep(0.05)
        assert client.stats()["allocated_bytes"] == LOW_PAGES * PAGE
        assert client.lookup(TENANT, chain, lock=False).count == LOW_PAGES
        head = client.retrieve(TENANT, chain[:1])
        assert head == [random.Random(0).randbytes(PAGE)]
