"""The agent's OpenAPI schema, fuzzed with schemathesis against a real agent process.

Every operation gets requests generated from the schema (with an admin token); each
answer must conform to the schema: no 5xx, documented status codes, bodies and
headers, a schema-valid request is never refused as malformed, and a 405's ``Allow``
is right. Bounded (a few dozen examples an operation, no shrinking database) so that
it stays a few seconds in the suite.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.support.agent_process import ADMIN_TOKEN, AgentProcess

pytestmark = pytest.mark.process

EXAMPLES_PER_OPERATION = 30


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    process = AgentProcess(Path(tmp_path_factory.mktemp("agent"))).start()
    yield process
    process.cleanup()


def test_every_operation_conforms_to_the_schema(agent: AgentProcess) -> None:
    schema = schemathesis.openapi.from_url(f"{agent.http}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def conforms(case: Any) -> None:
            case.call_and_validate(headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})

        conforms()
