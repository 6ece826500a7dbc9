"""``kvpool bench cluster`` run as a user runs it, with the tiny workload: two hosts (network
namespaces), one vLLM CPU server and one agent on each, the index with its picker behind
real Envoy, configurations 1 to 4 (configuration 5 needs a venv with LMCache, which this
machine need not have: its row must say so).

The checks read what the bench left in its ``--out`` folder and recompute each figure from
the raw sources with a parser of their own: every answer, and every endpoint's ``/metrics``
before and after each segment.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpool.tools.bench.cluster import workload
from tests.support.greedy import problems
from tests.support.hosts import hosts_or_skip

pytest.importorskip("vllm")
pytest.importorskip("matplotlib")

pytestmark = [
    pytest.mark.process,
    pytest.mark.engine,
    pytest.mark.root,
    pytest.mark.netns,
    pytest.mark.timeout(900),
]

SEED = 7
RATE = 1.5
CHUNK_TOKENS = 256
CONFIGS = (1, 2, 3, 4)
PHASES = {1: ("sweep", "flood"), 3: ("sweep", "flood")}
KVPOOL_PHASES = ("sweep", "flood", "flood+quotas")


@dataclass(frozen=True)
class Run:
    out: Path
    printed: dict[str, Any]
    """The bench's ``--json`` output: its command, tables and text."""
    results: dict[str, Any]

    def segments(self) -> list[dict[str, Any]]:
        return list(self.results["segments"])

    def answers(self, name: str) -> list[dict[str, Any]]:
        lines = (self.out / f"answers-{name}.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    def counter(self, name: str, when: str, prefix: str, metric: str, **labels: str) -> float:
        """The sum of ``metric`` (labels including ``labels``) over the endpoints whose file
        starts with ``prefix``, in the segment's ``before`` or ``after`` snapshot."""
        total = 0.0
        for path in (self.out / "metrics" / name / when).glob(f"{prefix}*.txt"):
            for line in path.read_text().splitlines():
                if line.startswith("#") or not line.startswith(metric):
                    continue
                series, value = line.rsplit(" ", 1)
                if series.split("{", 1)[0] != metric:
                    continue
                have = series.split("{", 1)[1].rstrip("}") if "{" in series else ""
                if all(f'{key}="{wanted}"' in have for key, wanted in labels.items()):
                    total += float(value)
        return total

    def delta(self, name: str, prefix: str, metric: str, **labels: str) -> int:
        after = self.counter(name, "after", prefix, metric, **labels)
        return round(after - self.counter(name, "before", prefix, metric, **labels))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    out = tmp_path_factory.mktemp("bench-cluster")
    with hosts_or_skip(1):  # this machine can make hosts (the bench makes its own)
        pass
    command = [
        str(Path(sys.executable).parent / "kvpool"),
        "bench",
        "cluster",
        "--workload",
        "tiny",
        "--seed",
        str(SEED),
        "--servers-per-host",
        "1",
        "--rates",
        str(RATE),
        "--configs",
        ",".join(map(str, CONFIGS)),
        "--out",
        str(out),
        "--json",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=840, check=False)
    assert done.returncode == 0, done.stderr[-6000:]
    results = json.loads((out / "results.json").read_text())
    yield Run(out, json.loads(done.stdout), results)


def expected_segments() -> set[tuple[int, str]]:
    return {(config, phase) for config in CONFIGS for phase in PHASES.get(config, KVPOOL_PHASES)}


def test_every_configuration_ran_and_served_every_request(run: Run) -> None:
    load = workload.generate(workload.PRESETS["tiny"], SEED)
    segments = run.segments()
    assert {(s["config"], s["phase"]) for s in segments} == expected_segments()
    for found in segments:
        expected = len(load.requests) + (len(load.flood) if found["phase"] != "sweep" else 0)
        answers = run.answers(found["name"])
        assert len(answers) == expected
        assert [a for a in answers if a["status"] != 200 or a["error"]] == [], found["name"]
        assert all(len(a["tokens"]) == load.params.output_tokens for a in answers)
        assert found["all"]["failed"] == 0 and found["checks"] == []
    assert "no LMCache venv" in run.results["not_run"]["5"]
    assert "no LMCache venv" in run.printed["text"]


def test_the_tables_token_split_is_the_servers_and_agents_own_counts(run: Run) -> None:
    by_source = "vllm:prompt_tokens_by_source_total"
    for found in run.segments():
        name, split = found["name"], found["split"]
        cache = run.delta(name, "vllm-", by_source, source="local_cache_hit")
        external = run.delta(name, "vllm-", by_source, source="external_kv_transfer")
        computed = run.delta(name, "vllm-", by_source, source="local_compute")
        fetched = run.delta(name, "agent-", "kvpool_peer_fetched_chunks_total")
        assert split["vllm_cache"] == cache, name
        assert split["recomputed"] == computed, name
        assert split["peer"] == min(external, fetched * CHUNK_TOKENS), name
        assert split["l1"] + split["peer"] == external, name
        if found["config"] in (1, 3):  # no connector
            assert external == 0, name
        else:  # what vLLM loaded through the connector is what the connector planned to load
            hits = run.delta(name, "vllm-", "vllm:kvpool_hit_tokens_total")
            assert hits == external, name


def test_every_answers_usage_agrees_with_the_servers_counters(run: Run) -> None:
    for found in run.segments():
        name, answers = found["name"], run.answers(found["name"])
        prompt = sum(a["prompt_tokens"] for a in answers)
        cached = sum(a["cached_tokens"] for a in answers)
        assert prompt == run.delta(name, "vllm-", "vllm:prompt_tokens_total"), name
        assert cached == run.delta(name, "vllm-", "vllm:prompt_tokens_cached_total"), name
        assert len(answers) == run.delta(name, "vllm-", "vllm:request_success_total"), name


def test_the_pool_serves_prompt_tokens_and_the_picker_routes(run: Run) -> None:
    segments = run.segments()
    for config in (2, 4):
        pooled = [s["split"]["l1"] + s["split"]["peer"] for s in segments if s["config"] == config]
        assert sum(pooled) > 0, f"configuration {config} loaded nothing through the pool"
    for found in segments:
        reasons = {a["pick"].split(";", 1)[0] for a in run.answers(found["name"])}
        if found["config"] in (3, 4):  # every request picked within the deadline
            assert reasons <= {"prefix", "load"}, (found["name"], reasons)
        else:
            assert reasons == {""}, (found["name"], reasons)


def answers_of(run: Run, config: int) -> list[dict[str, Any]]:
    return sorted(run.answers(f"{config}-sweep-{RATE:g}-0"), key=lambda a: a["id"])


def test_first_tokens_are_the_same_in_every_configuration(run: Run) -> None:
    reference = answers_of(run, 1)
    for config in CONFIGS[1:]:
        answers = answers_of(run, config)
        found = problems(
            [a["tokens"] for a in answers],
            [a["top"] for a in answers],
            [a["tokens"] for a in reference],
            [a["top"] for a in reference],
        )
        assert found == [], f"configuration {config}: {found}"


def test_the_comparison_of_first_tokens_can_fail(run: Run) -> None:
    """Each answer against another prompt's: what a wrong cache entry would give."""
    reference = answers_of(run, 1)
    shifted = reference[1:] + reference[:1]
    found = problems(
        [a["tokens"] for a in reference],
        [a["top"] for a in reference],
        [a["tokens"] for a in shifted],
        [a["top"] for a in shifted],
    )
    assert len(found) >= len(reference) - 1


def test_the_plot_the_tables_and_the_replay_file(run: Run) -> None:
    png = (run.out / "cluster.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    titles = [t["title"] for t in run.printed["tables"]]
    assert f"Rate {RATE:g} req/s (ratio to configuration 1)" in titles
    sweep = run.printed["tables"][0]
    assert [row[0] for row in sweep["rows"]] == [*map(str, CONFIGS)]
    assert sweep["rows"][0][2].endswith("(1.00x)")
    assert any(t.startswith("Isolation") for t in titles)
    assert "counters vs answers: agree in every segment" in run.printed["text"]
    replayed = workload.read_replay(run.out / "workload.jsonl")
    assert replayed.digest() == workload.generate(workload.PRESETS["tiny"], SEED).digest()
