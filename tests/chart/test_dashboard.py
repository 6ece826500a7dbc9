"""The Grafana dashboard: well formed, and every series it queries is one a real agent or
a real prefix index exports (read from their /metrics, so a renamed metric fails here)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.agent_process import AgentProcess
from tests.support.index_process import IndexProcess

from .conftest import CHART

pytestmark = pytest.mark.process

DASHBOARD = CHART / "dashboards" / "kvpool-agents.json"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """The sample names of a real agent with an L2 tier (so that L2 metrics exist) and of a
    real index following it."""
    work = tmp_path_factory.mktemp("dashboard-agent")
    nvme = json.dumps({"path": str(work / "nvme"), "capacity": "64MiB"})
    agent = AgentProcess(work / "agent", settings={"NVME": nvme})
    agent.workdir.mkdir()
    try:
        agent.start()
        index = IndexProcess(work / "index", {"n0": agent})
        try:
            text = httpx.get(f"{agent.http}/metrics", timeout=10).text
            text += httpx.get(f"{index.url}/metrics", timeout=10).text
        finally:
            index.stop()
    finally:
        agent.cleanup()
    names = set(re.findall(r"^(kvpool_\w+)", text, re.MULTILINE))  # samples
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        # families without samples yet (labelled ones before their first observation)
        base = family.removesuffix("_total") if kind == "counter" else family
        names |= {base + suffix for suffix in _SUFFIXES.get(kind, ("",))}
    return names


def _dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def _panels() -> Iterator[dict[str, Any]]:
    for panel in _dashboard()["panels"]:
        yield panel
        yield from panel.get("panels", ())


def _expressions() -> list[str]:
    return [target["expr"] for panel in _panels() for target in panel.get("targets", ())]


def test_every_queried_metric_is_exported(exported: set[str]) -> None:
    queried = {name for expr in _expressions() for name in re.findall(r"\bkvpool_\w+", expr)}
    assert queried, "the dashboard queries no kvpool metric"
    assert queried <= exported, f"not exported by the agent: {sorted(queried - exported)}"


@pytest.mark.parametrize(
    ("topic", "pattern"),
    [
        ("hit rate", r"kvpool_l1_hits_total.*/.*kvpool_l1_hits_total.*kvpool_l1_misses_total"),
        ("bytes", r"kvpool_l1_allocated_bytes"),
        ("evictions by cause", r"by \(cause\) \(rate\(kvpool_l1_evictions_total"),
        ("per-tenant usage", r"by \(tenant\) \(kvpool_tenant_used_bytes"),
        ("L2 latency", r"histogram_quantile\(0\.99, .*kvpool_l2_seconds_bucket"),
        ("write-back", r"kvpool_writeback_written_total"),
        ("prefetch", r"kvpool_prefetch_loaded_chunks_total"),
        ("index event lag", r"kvpool_index_event_lag_seconds"),
        ("routing decisions", r"by \(reason\) \(rate\(kvpool_index_route_decisions_total"),
    ],
)
def test_the_dashboard_shows(topic: str, pattern: str) -> None:
    assert any(re.search(pattern, expr) for expr in _expressions()), topic


def test_the_dashboard_is_well_formed() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] == "kvpool-agents"
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    ids = [panel["id"] for panel in _panels()]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for panel in _panels():
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        area = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"] and panel["description"], panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval"}
            assert used <= variables, f"{panel['title']}: undefined {used - variables}"


def test_the_dashboard_is_shipped_by_the_chart() -> None:
    template = (CHART / "templates" / "dashboard.yaml").read_text()
    assert f'.Files.Get "{DASHBOARD.relative_to(CHART)}"' in template
    assert Path(DASHBOARD).stat().st_size < 900 * 1024, "a ConfigMap holds at most 1 MiB"
