"""The figures and tables of ``kvpool bench cluster`` from made-up answers: percentiles,
medians over runs with their range, ratios to configuration 1, the checks of answers
against the servers' counters, the token split from ``/metrics`` texts, the P/D split of
inter-token gaps; and the options the bench refuses, each in one line."""

from __future__ import annotations

import argparse

import pytest

from kvpool.tools.bench.cluster import bench
from kvpool.tools.bench.cluster.configs import CONFIGS
from kvpool.tools.bench.cluster.driver import Answer
from kvpool.tools.bench.cluster.interference import gaps, interference
from kvpool.tools.bench.cluster.quantiles import quantile
from kvpool.tools.bench.cluster.results import Segment, checks, figures, segment
from kvpool.tools.bench.cluster.scrape import Snapshot, parse, split
from kvpool.tools.bench.cluster.tables import isolation_rows, pd_rows, sweep_rows
from kvpool.tools.bench.cluster.workload import PRESETS, generate
from kvpool.tools.bench.report import command


def answer(number: int, ttft: float, *, prompt: int = 1000, cached: int = 0) -> Answer:
    return Answer(
        number,
        "tenant-0" if number % 2 else "tenant-1",
        "group",
        sent=0.5 * number,
        status=200,
        ttft=ttft,
        e2e=ttft + 0.3,
        prompt_tokens=prompt,
        cached_tokens=cached,
        tokens=[5, 6, 7, 8],
    )


def made(config: int, ttfts: list[float], run: int = 0, phase: str = "sweep") -> Segment:
    answers = [answer(n, t, cached=500) for n, t in enumerate(ttfts)]
    counted = split(
        Snapshot({}),
        Snapshot(
            {
                "vllm-a": parse(
                    'vllm:prompt_tokens_by_source_total{source="local_cache_hit"} '
                    f"{250 * len(ttfts)}\n"
                    'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"} '
                    f"{250 * len(ttfts)}\n"
                    'vllm:prompt_tokens_by_source_total{source="local_compute"} '
                    f"{500 * len(ttfts)}\n"
                    f'vllm:request_success_total{{reason="length"}} {len(ttfts)}\n'
                ),
                "agent-host-0": parse('kvpool_peer_fetched_chunks_total{peer="host-1"} 1\n'),
            }
        ),
        chunk_tokens=256,
    )
    return segment(config, phase, 1.0, run, answers, split=counted, duration_s=2.0)


def test_quantiles_take_the_nearest_rank() -> None:
    values = [float(n) for n in range(1, 101)]
    assert quantile(values, 0.5) == 50.0
    assert quantile(values, 0.9) == 90.0
    assert quantile(values, 0.99) == 99.0
    assert quantile([3.0], 0.99) == 3.0
    assert quantile([], 0.5) is None


def test_figures_leave_failed_answers_out_and_count_them() -> None:
    failed = Answer(9, "tenant-0", "group", sent=0.0, status=503, error="HTTP 503")
    found = figures([answer(0, 0.1, cached=250), answer(1, 0.3, cached=750), failed])
    assert (found.requests, found.failed) == (3, 1)
    assert found.ttft_p50 == 0.1 and found.hit_rate == 0.5
    assert found.itl_p50 == 0.1  # 0.3 s after the first of 4 tokens


def test_the_split_caps_peer_tokens_at_what_the_connectors_loaded() -> None:
    found = made(2, [0.1, 0.2])
    assert (found.split.vllm_cache, found.split.peer, found.split.l1) == (500, 256, 244)
    assert found.split.recomputed == 1000 and found.split.requests == 2
    assert found.checks == []  # 2 x 1000 prompt tokens, 2 x 500 cached, 2 answers


def test_answers_that_disagree_with_the_counters_are_named() -> None:
    found = made(2, [0.1, 0.2])
    wrong = [answer(0, 0.1, prompt=999, cached=500), answer(1, 0.2, cached=500)]
    assert checks(wrong, found.split) == [
        "usage counts 1999 prompt tokens, the servers 2000",
    ]


def test_the_sweep_table_shows_medians_their_range_and_the_ratio_to_the_baseline() -> None:
    segments = [
        made(1, [1.0, 1.0], run=0),
        made(1, [3.0, 3.0], run=1),
        made(4, [0.2, 0.2], run=0),
        made(4, [0.4, 0.4], run=1),
        made(4, [0.3, 0.3], run=2),
    ]
    rows = sweep_rows(segments, [CONFIGS[0], CONFIGS[3], CONFIGS[4]], 1.0, {5: "not run: why"})
    assert rows[0][2] == "2.000 s [1.000 s-3.000 s] (1.00x)"
    assert rows[1][2] == "0.300 s [0.200 s-0.400 s] (0.15x)"
    assert rows[1][8:12] == ["25%", "12%", "13%", "50%"]
    assert rows[2][2] == "not run: why"


def test_the_isolation_table_compares_the_flood_with_the_same_configuration_alone() -> None:
    segments = [made(4, [0.2, 0.2]), made(4, [0.8, 0.8], phase="flood")]
    rows = isolation_rows(segments, [CONFIGS[3]], 1.0, {})
    assert rows[0][2:5] == ["flood", "0.200 s", "0.800 s (4.00x)"]
    assert rows[1][2:4] == ["flood+quotas", "not run"]


def test_the_command_line_leaves_unset_options_out() -> None:
    args = argparse.Namespace(rates=[1.0, 2.0], replay=None, json=False)
    assert command("kvpool bench cluster", args) == "command: kvpool bench cluster --rates 1.0,2.0"


def options(**changes: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return argparse.Namespace(**{**vars(parser.parse_args([])), **changes})


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"rates": [1.0, 0.0]}, "kvpool bench cluster --rates: [1.0, 0.0] is out of range"),
        ({"configs": [1, 7]}, "kvpool bench cluster --configs: [1, 7] is out of range"),
        ({"quota_share": 1.5}, "kvpool bench cluster --quota-share: 1.5 is out of range"),
        ({"servers_per_host": 0}, "kvpool bench cluster --servers-per-host: 0 is out of range"),
        ({"l1": "lots"}, "kvpool bench cluster --l1: "),
    ],
)
def test_a_value_the_bench_cannot_run_with_is_named_in_one_line(
    changes: dict[str, object], said: str
) -> None:
    bench.check(options())  # the defaults run
    with pytest.raises(SystemExit) as stopped:
        bench.check(options(**changes))
    message = str(stopped.value)
    assert message.startswith(said) and "\n" not in message


def streamed(number: int, kind: str, sent: float, times: list[float], pick: str = "") -> Answer:
    """An answer whose tokens came ``times`` seconds after ``sent`` (the first is its TTFT)."""
    return Answer(
        number,
        "tenant-0",
        kind,
        sent=sent,
        status=200,
        ttft=times[0],
        e2e=times[-1],
        prompt_tokens=3072 if kind == "long" else 64,
        tokens=[5] * len(times),
        token_times=times,
        pick=pick,
    )


def pd_answers(stall: float) -> list[Answer]:
    """A long prompt prefilled from 1 s to 2 s; a decode-heavy request streaming every
    10 ms from 0 s, but for one gap of ``stall`` at 1.5 s; another one long after."""
    steady = [0.01 * n for n in range(1, 151)]
    decode = [*steady, *(steady[-1] + stall + 0.01 * n for n in range(150))]
    return [
        streamed(0, "decode", 0.0, decode),
        streamed(1, "long", 1.0, [1.0, 1.01, 1.02], pick="pd; prefill=a"),
        streamed(2, "decode", 5.0, [0.1, 0.15, 0.2]),  # after the prefill: 50 ms gaps
    ]


def test_gaps_are_between_reads_in_the_segments_time() -> None:
    assert gaps(streamed(0, "decode", 2.0, [0.5, 1.0])) == [(2.5, 3.0)]
    # two tokens in one chunk, then a chunk read with them: one arrival
    answer = streamed(0, "decode", 0.0, [0.5, 0.75, 0.75, 0.7505, 1.0])
    assert gaps(answer) == [(0.5, 0.75), (0.7505, 1.0)]


def test_only_the_gaps_that_overlap_a_long_prefill_count_as_during_it() -> None:
    found = interference(pd_answers(stall=0.4))
    assert found is not None
    assert (found.long_requests, found.decode_requests) == (1, 2)
    assert found.gaps == 299 + 2
    assert found.gaps_during == 50 + 1 + 10  # 1.0 s to 2.0 s: the stall, 10 ms gaps around it
    assert found.itl_p99_during == pytest.approx(0.4)  # the stall: no mean per request hides it
    assert found.itl_p50_during == pytest.approx(0.01)
    assert found.itl_p99 == pytest.approx(0.01)  # over all 301 gaps, 3 are longer
    assert found.long_ttft_p50 == found.long_ttft_p99 == 1.0
    assert interference([a for a in pd_answers(0.4) if a.kind != "long"]) is None


def pd_segment(config: int, stall: float, run: int = 0) -> Segment:
    return segment(
        config,
        "sweep",
        1.0,
        run,
        pd_answers(stall),
        split=split(Snapshot({}), Snapshot({}), 256),
        duration_s=10.0,
    )


def test_the_pd_table_compares_with_configuration_4_over_runs() -> None:
    segments = [
        pd_segment(4, 0.4, run=0),
        pd_segment(4, 0.6, run=1),
        pd_segment(6, 0.02, run=0),
        pd_segment(6, 0.03, run=1),
        made(1, [0.2, 0.2]),  # no P/D figures: no row
    ]
    rows = pd_rows(segments, [CONFIGS[0], CONFIGS[3], CONFIGS[5]], 1.0)
    assert [row[0] for row in rows] == [4, 6]
    assert rows[0][3] == "500.0 ms [400.0 ms-600.0 ms] (1.00x)"
    assert rows[1][3] == "25.0 ms [20.0 ms-30.0 ms] (0.05x)"
    assert rows[1][5] == "1.000 s [1.000 s-1.000 s] (1.00x)"
    assert rows[1][10:] == ["2/2", 0]  # both long prompts were split, over the two runs


def test_pd_needs_a_workload_of_long_prompts() -> None:
    pd_config = [CONFIGS[3], CONFIGS[5]]
    bench.check_workload(pd_config, generate(PRESETS["tiny-pd"], 1))
    bench.check_workload(CONFIGS[:4], generate(PRESETS["tiny"], 1))
    with pytest.raises(SystemExit) as stopped:
        bench.check_workload(pd_config, generate(PRESETS["tiny"], 1))
    assert "needs a workload of long prompts" in str(stopped.value)
    assert "\n" not in str(stopped.value)
