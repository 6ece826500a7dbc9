"""``python -m e2e.run``'s own output: one line without the test environment, and the
summary table (of made-up evidence: the flow itself is ``test_e2e.py``'s)."""

from __future__ import annotations

import importlib.util
from importlib.machinery import ModuleSpec

import pytest

from tests.support.engines import Result

from . import run
from .scenario import Evidence


def test_without_the_test_environment_it_says_how_to_make_it_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    found = importlib.util.find_spec

    def without_vllm(name: str, package: str | None = None) -> ModuleSpec | None:
        return None if name in ("vllm", "kopf") else found(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", without_vllm)
    assert run.main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("python -m e2e.run: ") and " has no vllm, kopf: " in line
    assert line.endswith("with `make deps`, then run `.venv/bin/python -m e2e.run`")


def test_the_summary_is_a_table_of_checks_then_one_of_steps() -> None:
    top = [[[(5, -0.1), (7, -3.0)], [(6, -0.2), (8, -4.0)]]]
    first = Result([[5, 6]], [0], 1.5, {"stored_chunks": 8}, top)
    second = Result([[5, 6]], [2048], 0.25, {"loaded_chunks": 8}, top)
    evidence = Evidence(
        pool="main",
        pool_ready={"status": "True", "readyNodes": 2},
        children={"configmaps": ["kvpool-main-config"], "roles": []},
        agents={"node-a": "a1", "node-b": "b2"},
        first=first,
        second=second,
        on_node_b=None,
        status_a={"chunks": 8, "hits": 8},
        status_b={"chunks": 0},
        peers_b={"peers": [{"fetched_chunks": 8, "node": "node-a"}]},
        route={"node": "node-a", "reason": "prefix", "matched_tokens": 2048},
        route_other_salt={"node": "node-b", "reason": "least-loaded"},
        usage_before={"used_bytes": 4},
        quota_set={"limit_bytes": 2},
        usage_after={"used_bytes": 2, "evicted_chunks": 1},
        usage_after_tenant_delete={"chunks": 0},
        refused={"reason": "NamespaceNotAllowed"},
        tenant_ready={"status": "True"},
        seconds={"start the Kubernetes API server": 0.0, "done": 134.9},
    )
    checks, steps = run.summary(evidence).split("\n\n")
    rows = checks.splitlines()
    width = rows[0].index("shows")
    assert rows[0].split() == ["what", "shows"] and set(rows[1][: width - 2]) == {"-"}
    cells = {row[:width].strip(): row[width:] for row in rows[2:]}
    assert cells["pool"] == "main Ready=True, 2 nodes ready"
    assert cells["pool's children"] == "configmaps kvpool-main-config"
    assert cells["vllm-2 (node-a)"] == (
        "2048 cached tokens, loaded 8 chunks in 0.25 s; same output: yes"
    )
    assert cells["vllm-4 (node-b)"].startswith("- through the peer tier (8 chunks from node-a)")
    assert cells["pool deleted"].startswith("children left: none;")
    assert steps.splitlines()[2:] == [
        "0.0    start the Kubernetes API server",
        "134.9  done",
    ]
