"""The peer bench (``python -m benchmarks.peer``, not shipped): its smallest runs between two
hosts print the transfer table and the readers' table, and its reports' rates, ratios and
checks on made-up figures."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import peer_nixl, peer_passes, peer_ttft
from benchmarks.peer import PROTECTIONS, SOCKET, MiB, Results, main, report, side_name
from benchmarks.peer_passes import Passes, passes_of
from benchmarks.peer_ttft import READERS, RECOMPUTE
from kvpool.tools.bench.connector_engine import Sample
from kvpool.tools.bench.cpu_features import AVX2_ONLY, take
from kvpool.tools.bench.local.peers import TRANSPORTS
from kvpool.tools.bench.report import (
    CIPHER_FEATURES,
    add_chunk_mib,
    chunk_bytes,
    chunk_label,
    command,
    machine,
    recording,
)
from tests.support.engines import needs_fast_bf16
from tests.support.hosts import hosts_or_skip

ROOT = Path(__file__).resolve().parents[2]
BENCH = [sys.executable, "-m", "benchmarks.peer"]
"""The bench, run from the checkout's root."""


def rows_of(output: str) -> list[list[str]]:
    """The transfer table's rows, each cell as shown (stripped; the columns' spans are the
    runs of dashes under the header)."""
    lines = output.splitlines()
    (rule,) = [n for n, line in enumerate(lines) if line.startswith("-----  ------")]
    spans = [match.span() for match in re.finditer(r"-+", lines[rule])]
    rows = []
    for line in lines[rule + 1 :]:
        if not line.startswith((" ", *"0123456789")):
            break
        rows.append([line[start:end].strip() for start, end in spans])
    return rows


@pytest.mark.process
@pytest.mark.root
@pytest.mark.netns
def test_the_smallest_run_pulls_through_the_peer_and_measures_the_link() -> None:
    with hosts_or_skip(1):  # this machine can make hosts
        pass
    command = [*BENCH, "--chunk-mib", "1,2", "--mib", "4", "--runs", "2", "--skip-ttft"]
    output = subprocess.run(
        command, capture_output=True, text=True, timeout=120, check=True, cwd=ROOT
    ).stdout

    rows = rows_of(output)
    peers = [
        side_name(transport, protection) for transport in TRANSPORTS for protection in PROTECTIONS
    ]
    sides = [SOCKET, peer_nixl.NAME, *peers]  # NIXL: a test dependency
    assert [row[:3] for row in rows] == [
        ["1 MiB", "4", sides[0]],
        *(["", "", side] for side in sides[1:]),
        ["2 MiB", "2", sides[0]],
        *(["", "", side] for side in sides[1:]),
    ], output
    figures, cpu = r"\d+\.\d\d \[\d+\.\d\d-\d+\.\d\d\]", r"\d+\.\d\d / \d+\.\d\d"
    for row in rows:  # GB/s and CPU of each side
        assert re.fullmatch(figures, row[3]) and re.fullmatch(cpu, row[4]), row
    for row in rows:  # ratios to the socket (all but the socket); to the raw rate, the bound
        assert re.fullmatch(figures, row[5]) if row[2] != SOCKET else row[5] == "", row
        assert re.fullmatch(figures, row[6]) if row[2] in peers else row[6] == "", row
        assert re.fullmatch(figures, row[7]) if row[2] in peers else row[7] == "", row
    # every agent's goal, marked where this machine missed it
    goals = [row[8].removesuffix(" MISSED") for row in rows]
    small, large = [">= 0.6 raw"] * 4, [">= 0.8 socket", ">= 0.9 raw"] * 2
    assert goals == ["", "", *small, "", "", *large], output
    assert "not measured" not in output
    assert "over veth (MTU " in output
    # the bound's passes, measured per chunk size
    carried = r"the cores carry \(GB/s\)( (tcp|nixl) (sealed|integrity) \d+\.\d\d,?){4}"
    passes = r"seal \d\.\d\d, copy and tag \d\.\d\d, open \d\.\d\d, tag \d\.\d\d, copy \d\.\d\d"
    for size in ("1 MiB", "2 MiB"):
        assert re.search(rf"\n  {size}: {passes}; {carried}\n", output), output
    assert "every chunk B pulled was A's, byte for byte: yes" in output
    assert "command: python -m benchmarks.peer --chunk-mib 1,2 --mib 4 --runs 2 " in output
    assert "--wire sealed,integrity" in output
    assert "--transport tcp,nixl" in output
    assert "--skip-ttft" in output
    assert "Reader TTFT" not in output
    assert "CPU: " in output


@pytest.mark.process
@pytest.mark.root
@pytest.mark.netns
def test_the_pull_profile_pulls_with_each_max_transfers_and_shows_the_cpu_and_idle() -> None:
    """``benchmarks.peer_pull_profile``: a pair of agents per ``--max-transfers``, each row
    the pulls' rate, both agents' CPU per GB, their busiest threads and the idle cores."""
    with hosts_or_skip(1):
        pass
    command = [sys.executable, "-m", "benchmarks.peer_pull_profile", "--chunk-mib", "1"]
    command += ["--mib", "4", "--pulls", "2", "--max-transfers", "1,2", "--as-avx2"]
    output = subprocess.run(
        command, capture_output=True, text=True, timeout=120, check=True, cwd=ROOT
    ).stdout

    rows = rows_of(output)
    assert [row[:2] for row in rows] == [["1 MiB", "1"], ["1 MiB", "2"]], output
    number, cpu = r"\d+\.\d\d", r"\d+\.\d\d / \d+\.\d\d"
    threads = r"\d+\.\d\d( \d+\.\d\d){0,3}"
    for row in rows:
        assert re.fullmatch(number, row[2]) and float(row[2]) > 0, row
        assert all(re.fullmatch(cpu, cell) for cell in row[3:5]), row
        assert all(re.fullmatch(threads, cell) for cell in row[5:7]), row
        assert re.fullmatch(number, row[7]), row
    assert "command: python -m benchmarks.peer_pull_profile --chunk-mib 1 --mib 4 " in output
    assert "CPU: " in output
    assert f"CPU features masked: OPENSSL_ia32cap={AVX2_ONLY['OPENSSL_ia32cap']} " in output


_AES_GCM_RATE = """
import os, time
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
cipher, data, best = AESGCM(os.urandom(32)), os.urandom(4 << 20), float("inf")
for _ in range(7):
    started = time.perf_counter()
    cipher.encrypt(os.urandom(12), data, None)
    best = min(best, time.perf_counter() - started)
print(len(data) / best)
"""


def _aes_gcm_rate(environment: dict[str, str]) -> float:
    """Bytes a second a fresh process seals with AES-GCM (OpenSSL's, as the agents')."""
    return float(
        subprocess.run(
            [sys.executable, "-c", _AES_GCM_RATE],
            env={**os.environ, **environment},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    )


@pytest.mark.process
@pytest.mark.skipif(
    not {"avx512f", "avx512vl", "vaes", "vpclmulqdq"}
    <= set(Path("/proc/cpuinfo").read_text().split()),
    reason="OpenSSL seals with VAES only beside AVX-512, which this CPU lacks: nothing to hide",
)
def test_as_avx2_hides_from_openssl_what_an_avx2_cpu_lacks() -> None:
    """``--as-avx2`` (on a CPU with VAES and VPCLMULQDQ): the processes a bench starts seal
    at an AVX2-only CPU's rate (AES-NI and PCLMULQDQ alone: about a quarter), and every
    bench's machine line says so."""
    assert _aes_gcm_rate(AVX2_ONLY) < 0.6 * _aes_gcm_rate({})
    args = argparse.Namespace(as_avx2=True)
    with pytest.MonkeyPatch.context() as patch:
        for name in AVX2_ONLY:
            patch.delenv(name, raising=False)
        assert "masked" not in machine()
        take(args)
        assert all(os.environ[name] == value for name, value in AVX2_ONLY.items())
        assert machine().endswith(
            f"; CPU features masked: OPENSSL_ia32cap={AVX2_ONLY['OPENSSL_ia32cap']} "
            f"GLIBC_TUNABLES={AVX2_ONLY['GLIBC_TUNABLES']}"
        )


def test_the_machine_line_names_the_features_the_cipher_runs_on() -> None:
    """The ciphers' speed, and so every figure of the peer bench, depends on them."""
    flags = next(
        (
            set(line.split(":", 1)[1].split())
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        ),
        set(),
    )
    if "aes" not in flags:
        pytest.skip("no AES-NI on this CPU: the line names no cipher features")
    has = " ".join(name for name in CIPHER_FEATURES if name in flags)
    lacks = " ".join(name for name in CIPHER_FEATURES if name not in flags)
    expected = "; ".join(part for part in (has, lacks and f"no {lacks}") if part)
    said = re.search(r"^CPU: .* \(([^)]*)\), \d+ CPUs;", machine())
    assert said is not None and said.group(1) == expected, machine()


@pytest.mark.process
@pytest.mark.engine
@pytest.mark.root
@pytest.mark.netns
@needs_fast_bf16
def test_the_smallest_readers_run_loads_through_the_peer_and_s3() -> None:
    with hosts_or_skip(1):
        pass
    command = [*BENCH, "--chunk-mib", "1", "--mib", "1", "--runs", "1", "--skip-peer"]
    command += ["--prompt-tokens", "512"]
    output = subprocess.run(
        command, capture_output=True, text=True, timeout=300, check=True, cwd=ROOT
    ).stdout

    (table,) = [block for block in output.split("\n\n") if block.startswith("Reader TTFT")]
    rows = [re.split(r" {2,}", line.strip()) for line in table.splitlines()[3:6]]
    assert [row[0] for row in rows] == [*READERS.values(), "recompute (no connector)"], output
    # one chunk of the 512 tokens loaded (vLLM computes the last token), none recomputed
    assert [row[-1] for row in rows] == ["256", "256", "0"]  # one run: no [min-max]
    for row in rows:
        assert re.fullmatch(r"\d+\.\d", row[1]), row
    assert "peer: every reader loaded 256 tokens from the pool: yes" in output
    assert "S3: every reader loaded 256 tokens from the pool: yes" in output


def test_report_rates_ratios_per_run_the_bound_and_the_goals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    args = argparse.Namespace(
        chunk_mib=[1, 2],
        mib=4,
        runs=2,
        skip_peer=False,
        wire=["sealed", "integrity"],
        transport=["tcp", "nixl"],
    )
    counts = {MiB: 4, 2 * MiB: 2}
    moved = 4 * MiB
    gb = 2 * moved / 1e9  # both runs
    tcp, nixl = side_name("tcp", "integrity"), side_name("nixl", "sealed")
    # GB/s of each run, by side and chunk size
    rates = {
        (SOCKET, MiB): [2, 4],
        (peer_nixl.NAME, MiB): [3, 3.2],
        (tcp, MiB): [1.4, 2],  # / socket 0.7 and 0.5: / raw the same (tcp's raw: the socket)
        (nixl, MiB): [2.1, 1.6],  # / raw 0.7 and 0.5
        (SOCKET, 2 * MiB): [2, 2],
        (peer_nixl.NAME, 2 * MiB): [2.2, 2],
        (tcp, 2 * MiB): [1.9, 1.7],  # / socket (its raw) 0.95 and 0.85
        (nixl, 2 * MiB): [1.8, 1.4],  # / socket 0.9 and 0.7
    }
    # the raw sides' 0.3 s/GB and the passes: the cores (2) carry tcp integrity at
    # 2 / (0.3 + 0.25 + 0.25) = 2.5 GB/s (its sender tags the chunk where it lies) and nixl
    # sealed at 2 / (0.3 + 0.4 + 0.4) = 1.82 (a sealed chunk opens from the landing: no copy
    # out of it first)
    passes = Passes(seal=0.4, copy_tag=0.3, open_sealed=0.4, check_tag=0.25, copy=0.1)
    results = Results(
        seconds={key: [moved / (rate * 1e9) for rate in runs] for key, runs in rates.items()},
        cpu={key: [0.1 * gb, 0.2 * gb] for key in rates},
        passes={MiB: passes, 2 * MiB: passes},
    )
    # of the four sides the arguments name, this made-up run has tcp integrity and nixl sealed
    with recording() as tables:
        text = report(results, args, counts, "1500")
    cpu = "0.10 / 0.20"
    # chunk, chunks, side, GB/s, CPU s/GB A / B, / socket, / raw, / bound, goal
    assert tables[0]["rows"] == [
        ["1 MiB", "4", SOCKET, "3.00 [2.00-4.00]", cpu, "", "", "", ""],
        ["", "", peer_nixl.NAME, "3.10 [3.00-3.20]", cpu, "1.15 [0.80-1.50]", "", "", ""],
        [
            "",
            "",
            tcp,
            "1.70 [1.40-2.00]",
            cpu,
            "0.60 [0.50-0.70]",
            "0.60 [0.50-0.70]",
            "0.75 [0.70-0.80]",  # over 2 and 2.5 (the cores)
            ">= 0.6 raw",
        ],
        [
            "",
            "",
            nixl,
            "1.85 [1.60-2.10]",
            cpu,
            "0.73 [0.40-1.05]",
            "0.60 [0.50-0.70]",
            "1.02 [0.88-1.16]",  # over 1.82 (the cores) in both runs
            ">= 0.6 raw",
        ],
        ["2 MiB", "2", SOCKET, "2.00 [2.00-2.00]", cpu, "", "", "", ""],
        ["", "", peer_nixl.NAME, "2.10 [2.00-2.20]", cpu, "1.05 [1.00-1.10]", "", "", ""],
        [
            "",
            "",
            tcp,
            "1.80 [1.70-1.90]",
            cpu,
            "0.90 [0.85-0.95]",
            "0.90 [0.85-0.95]",
            "0.90 [0.85-0.95]",  # over the socket's 2
            ">= 0.9 raw",
        ],
        [
            "",
            "",
            nixl,
            "1.60 [1.40-1.80]",
            cpu,
            "0.80 [0.70-0.90]",
            "0.76 [0.70-0.82]",
            "0.88 [0.77-0.99]",
            ">= 0.8 socket",
        ],
    ]
    assert "1 MiB: seal 0.40, copy and tag 0.30, open 0.40, tag 0.25, copy 0.10;" in text
    assert "the cores carry (GB/s) tcp integrity 2.50, nixl sealed 1.82" in text
    assert "every chunk B pulled was A's, byte for byte: yes" in text
    assert f"{tcp} >= 0.6 x {SOCKET} (median ratio), chunks under 2 MiB: yes" in text
    assert f"{tcp} >= 0.9 x {SOCKET} (median ratio), chunks from 2 MiB: yes" in text
    assert f"{nixl} >= 0.6 x {peer_nixl.NAME} (median ratio), chunks under 2 MiB: yes" in text
    assert f"{nixl} >= 0.8 x {SOCKET} (median ratio), chunks from 2 MiB: yes" in text
    assert "not measured" not in text

    seconds = {**results.seconds, (nixl, 2 * MiB): [moved / 1e9] * 2}  # 1 GB/s: 0.5 x socket
    slower = Results(
        seconds=seconds,
        cpu=results.cpu,
        intact=False,
        unmeasured={"something": "why"},
        passes=results.passes,
    )
    with recording() as tables:
        text = report(slower, args, counts, "1500")
    assert "byte for byte: NO" in text
    assert tables[0]["rows"][7][8] == ">= 0.8 socket MISSED"
    assert "something: not measured: why" in text
    # what the bound allows there: 1.82 GB/s (the cores) over the socket's 2
    claim = f"{nixl} >= 0.8 x {SOCKET} (median ratio), chunks from 2 MiB"
    assert f"{claim}: NO (its bound here is 0.91 x)" in text
    assert f"{tcp} >= 0.9 x {SOCKET} (median ratio), chunks from 2 MiB: yes" in text


def test_the_passes_are_each_measured_and_summed_by_side(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound's passes: each one's CPU per GB, the agents' own code on one thread; a
    side's are its sender's and its receiver's (under integrity the TCP sender tags the
    chunk where it lies, the NIXL one copies it to its staging buffer and tags the copy,
    and NIXL's receiver copies it out of the landing: a sealed chunk opens from it)."""
    monkeypatch.setattr(peer_passes, "COLD_BYTES", 12 * MiB)  # the test's, not the bench's
    passes = passes_of(MiB)
    figures = [passes.seal, passes.copy_tag, passes.open_sealed, passes.check_tag, passes.copy]
    assert all(0 < figure < 60 for figure in figures), passes  # under a minute a GB
    made_up = Passes(seal=0.4, copy_tag=0.3, open_sealed=0.5, check_tag=0.2, copy=0.1)
    assert made_up.per_gb("tcp", "sealed") == pytest.approx(0.9)
    assert made_up.per_gb("tcp", "integrity") == pytest.approx(0.4)
    assert made_up.per_gb("nixl", "sealed") == pytest.approx(0.9)
    assert made_up.per_gb("nixl", "integrity") == pytest.approx(0.6)


def test_report_without_the_peer_has_the_link_alone() -> None:
    args = argparse.Namespace(
        chunk_mib=[2], mib=4, runs=1, skip_peer=True, wire=["sealed"], transport=["tcp"]
    )
    link = Results(seconds={(SOCKET, 2 * MiB): [4 * MiB / 2e9]}, cpu={(SOCKET, 2 * MiB): [0, 0]})
    text = report(link, args, {2 * MiB: 2}, "1500")

    assert rows_of(text) == [["2 MiB", "2", SOCKET, "2.00", "0.00 / 0.00", "", "", "", ""]]
    assert "peer" not in text


def test_a_wire_protection_the_agents_do_not_have_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--wire", "sealed,none"])
    assert exited.value.code == 2
    assert "--wire: expected some of sealed,integrity, not 'sealed,none'" in capsys.readouterr().err


def test_readers_report_ratios_to_recompute_and_what_each_loaded() -> None:
    model = {"layers": 8, "hidden": 512, "kv_heads": 4}  # 8 KiB of KV per token
    args = argparse.Namespace(prompt_tokens=1024, chunk_tokens=256, **model)

    def sample(seconds: float, hit_tokens: int, token: int = 7) -> Sample:
        return Sample(seconds, hit_tokens, token, connector_us={}, hit_tokens=hit_tokens)

    runs = [
        {"peer": sample(0.02, 768), "S3": sample(0.05, 768), RECOMPUTE: sample(0.1, 0)},
        {"peer": sample(0.04, 768), "S3": sample(0.05, 512, 8), RECOMPUTE: sample(0.1, 0)},
    ]
    text = peer_ttft.report(runs, args)
    rows = [re.split(r" {2,}", line.strip()) for line in text.splitlines()[3:6]]

    # reader, TTFT ms, vs recompute, pool tokens: median [min-max]
    peer = ["30.0 [20.0-40.0]", "0.300 [0.200-0.400]", "768 [768-768]"]
    assert rows[0] == [READERS["peer"], *peer]
    s3 = ["50.0 [50.0-50.0]", "0.500 [0.500-0.500]", "640 [512-768]"]
    assert rows[1] == [READERS["S3"], *s3]
    assert rows[2] == ["recompute (no connector)", "100.0 [100.0-100.0]", "0 [0-0]"]
    assert "3 chunks of 256 tokens to load, 6 MiB of KV" in text
    assert "peer: every reader loaded 768 tokens from the pool: yes" in text
    assert "S3: every reader loaded 768 tokens from the pool: NO" in text
    assert "first tokens, readers = recompute: 3 of 4" in text


def test_chunk_sizes_under_a_mib_are_fractions_and_read_as_kib() -> None:
    parser = argparse.ArgumentParser()
    add_chunk_mib(parser)
    args = parser.parse_args(["--chunk-mib", "0.25,2,32"])
    assert args.chunk_mib == [0.25, 2, 32]  # whole numbers stay whole: the command reads as typed
    assert [chunk_bytes(mib) for mib in args.chunk_mib] == [256 << 10, 2 * MiB, 32 * MiB]
    assert [chunk_label(chunk_bytes(mib)) for mib in args.chunk_mib] == [
        "256 KiB",
        "2 MiB",
        "32 MiB",
    ]
    assert "--chunk-mib 0.25,2,32" in command("python -m benchmarks.peer", args)
