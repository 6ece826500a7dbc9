"""``kvpool-agent`` and ``kvpool`` (tenant-id, bench) given broken inputs: one line per
problem, naming the file, the setting or variable as written and the value; exit 2. The
tables run through each script's ``main(argv)``; a row of each and the ports held run the
scripts as processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvpool.agent import main as agent
from kvpool.tools import cli
from tests.support.mistakes import BIN, Mistake, feed, held_port, refuse

FILE = ["--config", "{tmp}/agent.yaml"]
STARTS = {
    "KVPOOL_POOL": "mistakes",
    "KVPOOL_SEGMENT_PATH": "{tmp}/segment",
    "KVPOOL_L1_SIZE": "4Mi",
    "KVPOOL_STATE_DIR": "{tmp}/state",
    "KVPOOL_ZMQ_PORT": "0",
    "KVPOOL_HTTP_PORT": "0",
    "KVPOOL_EVENTS_PORT": "0",
}
"""Settings of an agent that gets as far as opening its tiers (and then stops, refused)."""
QUIET = ["--log-level", "warning"]

AGENT = [
    Mistake(
        "yaml-syntax",
        FILE,
        ["kvpool-agent: {tmp}/agent.yaml: not YAML or JSON: line 2, column 1: expected ','"],
        files={"agent.yaml": "l1_size: [1\n"},
    ),
    Mistake(
        "file-not-a-mapping",
        FILE,
        ["kvpool-agent: {tmp}/agent.yaml: expected a mapping of settings, got a list"],
        files={"agent.yaml": "- l1_size: 1Gi\n"},
    ),
    Mistake(
        "file-absent",
        ["--config", "{tmp}/absent.yaml"],
        [
            "kvpool-agent: {tmp}/absent.yaml: cannot read the configuration file: "
            "No such file or directory"
        ],
    ),
    Mistake(
        "file-not-text",
        FILE,
        ["kvpool-agent: {tmp}/agent.yaml: not UTF-8 text (byte 9)"],
        files={"agent.yaml": "l1_size: \udcff\n"},
    ),
    Mistake(
        "file-unknown-key",
        FILE,
        ["kvpool-agent: {tmp}/agent.yaml: l1_sise=1Gi: unknown setting; did you mean l1_size?"],
        files={"agent.yaml": "l1_sise: 1Gi\n"},
    ),
    Mistake(
        "file-l1-size-nested",
        FILE,
        [
            'kvpool-agent: {tmp}/agent.yaml: l1={"size": "64Mi"}: unknown setting; '
            "did you mean l1_size?"
        ],
        files={"agent.yaml": "l1:\n  size: 64Mi\n"},
    ),
    Mistake(
        "file-two-problems",
        FILE,
        [
            "kvpool-agent: {tmp}/agent.yaml: nvme.capacity: required, not set",
            "kvpool-agent: {tmp}/agent.yaml: store_policy=some: input should be 'all' or 'reused'",
        ],
        files={"agent.yaml": "nvme:\n  path: /mnt/nvme\nstore_policy: some\n"},
    ),
    Mistake(
        "file-nested-size",
        FILE,
        [
            "kvpool-agent: {tmp}/agent.yaml: http_limits.max_body_bytes=1MB: ambiguous unit MB: "
            "write 1M (M: 10^6) or 1Mi (Mi: 2^20)"
        ],
        files={"agent.yaml": "http_limits:\n  max_body_bytes: 1MB\n"},
    ),
    Mistake(
        "env-not-a-number",
        [],
        ["kvpool-agent: KVPOOL_ZMQ_PORT=http: input should be a valid integer"],
        env={"KVPOOL_ZMQ_PORT": "http"},
    ),
    Mistake(
        "env-ambiguous-size",
        [],
        ["kvpool-agent: KVPOOL_L1_SIZE=64GB: ambiguous unit GB: write 64G (G: 10^9) or 64Gi"],
        env={"KVPOOL_L1_SIZE": "64GB"},
    ),
    Mistake(
        "env-fraction-size",
        [],
        ["kvpool-agent: KVPOOL_L1_SIZE=1.5Gi: not a whole quantity: write 1536Mi"],
        env={"KVPOOL_L1_SIZE": "1.5Gi"},
    ),
    Mistake(
        "env-nested-missing",
        [],
        ["kvpool-agent: KVPOOL_NVME__CAPACITY: required, not set"],
        env={"KVPOOL_NVME__PATH": "/mnt/nvme"},
    ),
    Mistake(
        "env-not-json",
        [],
        ["kvpool-agent: KVPOOL_NVME={bad: should be a mapping of settings (a JSON object)"],
        env={"KVPOOL_NVME": "{bad"},
    ),
    Mistake(
        "env-rule",
        [],
        [
            "kvpool-agent: KVPOOL_LOW_WATERMARK=0.95: low_watermark (0.95) must be below "
            "high_watermark (0.9)"
        ],
        env={"KVPOOL_LOW_WATERMARK": "0.95"},
    ),
    Mistake(
        "env-and-file-rule",
        FILE,
        [
            "kvpool-agent: KVPOOL_L1_SIZE=512Ki, {tmp}/agent.yaml: page_size=64Ki: l1_size must "
            "hold at least 16 pages of 65536 bytes"
        ],
        env={"KVPOOL_L1_SIZE": "512Ki"},
        files={"agent.yaml": "page_size: 64Ki\n"},
    ),
    Mistake(
        "env-segment-path-empty",
        [],
        ['kvpool-agent: KVPOOL_SEGMENT_PATH="": must be an absolute path to a file'],
        env={"KVPOOL_SEGMENT_PATH": ""},
    ),
    Mistake(
        "env-segment-path-relative",
        [],
        ["kvpool-agent: KVPOOL_SEGMENT_PATH=relative: must be an absolute path to a file"],
        env={"KVPOOL_SEGMENT_PATH": "relative"},
    ),
    Mistake(
        "file-segment-path-root",
        FILE,
        ["kvpool-agent: {tmp}/agent.yaml: segment_path=/: must be an absolute path to a file"],
        files={"agent.yaml": "segment_path: /\n"},
    ),
    Mistake(
        "env-size-too-large",
        [],
        [
            "kvpool-agent: KVPOOL_L1_SIZE=99999999999999999999999999: too large: a size is "
            "below 2^63 bytes"
        ],
        env={"KVPOOL_L1_SIZE": "99999999999999999999999999"},
    ),
    Mistake(
        "env-size-bytes-suffix",
        [],
        ["kvpool-agent: KVPOOL_L1_SIZE=64B: unknown unit B"],
        env={"KVPOOL_L1_SIZE": "64B"},
    ),
    Mistake(
        "env-s3-endpoint",
        [],
        [
            'kvpool-agent: KVPOOL_S3.endpoint_url="not a url": must be an http:// or https:// '
            "URL with a host"
        ],
        env={"KVPOOL_S3": '{"bucket": "b", "endpoint_url": "not a url"}'},
    ),
    Mistake(
        "env-s3-region",
        [],
        ['kvpool-agent: KVPOOL_S3.region="bad region!": must be a region name'],
        env={"KVPOOL_S3": '{"bucket": "b", "region": "bad region!"}'},
    ),
    Mistake(
        "env-s3-region-botocore",
        QUIET,
        ["kvpool-agent: s3.region=12345: Provided region_name '12345' doesn't match"],
        env={**STARTS, "KVPOOL_S3": '{"bucket": "b", "region": "12345"}'},
    ),
    Mistake(
        "env-tokens-file-absent",
        QUIET,
        [
            "kvpool-agent: KVPOOL_TOKENS_FILE={tmp}/absent.yaml: cannot read tokens file: "
            "No such file or directory"
        ],
        env={**STARTS, "KVPOOL_TOKENS_FILE": "{tmp}/absent.yaml"},
    ),
    Mistake(
        "env-nvme-path-under-a-file",
        QUIET,
        [
            "kvpool-agent: KVPOOL_NVME__PATH={tmp}/agent.yaml/nvme: cannot make the directory: "
            "Not a directory"
        ],
        env={
            **STARTS,
            "KVPOOL_NVME__PATH": "{tmp}/agent.yaml/nvme",
            "KVPOOL_NVME__CAPACITY": "1Mi",
        },
        files={"agent.yaml": ""},
    ),
    Mistake(
        "file-nvme-path-under-a-file",
        [*FILE, *QUIET],
        [
            "kvpool-agent: {tmp}/agent.yaml: nvme.path={tmp}/agent.yaml/nvme: cannot make the "
            "directory: Not a directory"
        ],
        env=STARTS,
        files={"agent.yaml": "nvme:\n  path: {tmp}/agent.yaml/nvme\n  capacity: 1Mi\n"},
    ),
    Mistake(
        "env-state-dir-in-proc",
        QUIET,
        ["kvpool-agent: KVPOOL_STATE_DIR=/proc/x: cannot make the directory: No such file"],
        env={**STARTS, "KVPOOL_STATE_DIR": "/proc/x"},
    ),
    Mistake(
        "file-state-dir-under-a-file",
        [*FILE, *QUIET],
        [
            "kvpool-agent: {tmp}/agent.yaml: state_dir={tmp}/agent.yaml/state: cannot make the "
            "directory: Not a directory"
        ],
        env={k: v for k, v in STARTS.items() if k != "KVPOOL_STATE_DIR"},
        files={"agent.yaml": "state_dir: {tmp}/agent.yaml/state\n"},
    ),
    Mistake(
        "unknown-flag",
        ["--bogus"],
        ["kvpool-agent: unrecognized arguments: --bogus"],
    ),
    Mistake(
        "log-level",
        ["--log-level", "loud"],
        ["kvpool-agent: argument --log-level: Unknown level: 'LOUD'"],
    ),
]


@pytest.mark.parametrize("mistake", AGENT, ids=str)
def test_agent(mistake: Mistake, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    refuse(agent.main, mistake, tmp_path, capsys)


@pytest.mark.process
@pytest.mark.parametrize("setting", ["zmq_port", "events_port", "http_port"])
def test_agent_port_in_use(setting: str, tmp_path: Path) -> None:
    segment = Path("/dev/shm") / f"kvpool-test-mistakes-{os.getpid()}"
    env = {
        "KVPOOL_SEGMENT_PATH": str(segment),
        "KVPOOL_L1_SIZE": "4Mi",
        "KVPOOL_STATE_DIR": str(tmp_path / "state"),
        **{f"KVPOOL_{port.upper()}": "0" for port in ("zmq_port", "events_port", "http_port")},
        f"KVPOOL_{setting.upper()}": "{port}",
    }
    mistake = Mistake(
        setting,
        ["--log-level", "warning"],
        [f"kvpool-agent: port {{port}} ({setting}) is in use on 127.0.0.1"],
        env=env,
    )
    try:
        with held_port() as port:
            feed(f"{BIN}/kvpool-agent", mistake, tmp_path, port=port)
    finally:
        for path in segment.parent.glob(f"{segment.name}*"):
            path.unlink()


KVPOOL = [
    Mistake("no-command", [], ["kvpool: the following arguments are required: command"]),
    Mistake("unknown-command", ["frob"], ["kvpool: argument command: invalid choice: 'frob'"]),
    Mistake("tenant-id-two-salts", ["tenant-id", "a", "b"], ["kvpool: unrecognized arguments: b"]),
    Mistake(
        "unknown-bench",
        ["bench", "nosuch"],
        ["kvpool bench: argument bench: invalid choice: 'nosuch'"],
    ),
    Mistake(
        "bench-flag",
        ["bench", "chains", "--l1-mib", "x"],
        ["kvpool bench chains: argument --l1-mib: expected a whole number, not 'x'"],
    ),
]


BENCH_FLAGS = [
    ("l1", "--chunks", "0", "expected a number above 0, not 0"),
    ("l1", "--policy", "fifo", "invalid choice: 'fifo'"),
    ("l1", "--copy-mib", "-1", "expected a number above 0, not -1"),
    ("chains", "--chunk-kib", "0", "expected a number above 0, not 0"),
    ("service", "--chunk-sizes", "abc", "expected a whole number, not 'abc'"),
    ("service", "--clients", "1,0", "expected a number above 0, not 0"),
    ("writeback", "--chunks", "-1", "expected a number above 0, not -1"),
    ("tenants", "--tenants", "0", "expected a number above 0, not 0"),
    ("connector", "--queued", "-1", "expected a number of 0 or more, not -1"),
    ("connector", "--configs", "kvpool,vllm", "unknown configs ['vllm']; known: none, kvpool"),
    ("windows", "--window", "0", "expected a number above 0, not 0"),
    ("windows", "--full-every", "1", "expected 2 or more (1 is every layer full), not 1"),
    ("gpu", "--chunk-tokens", "100", "expected multiples of vLLM's 16-token blocks, not 100"),
    ("gpu", "--models", "llama", "unknown llama; choose from llama3-8b, small-heads, mla,"),
    ("gpu", "--l1-size", "6GB", "ambiguous unit GB: write 6G (G: 10^9) or 6Gi (Gi: 2^30)"),
]
"""Benchmark flags out of range: (bench, flag, value, what is wrong)."""
KVPOOL += [
    Mistake(
        f"bench-{bench}{flag}={value}",
        ["bench", bench, flag, value],
        [f"kvpool bench {bench}: argument {flag}: {message}"],
    )
    for bench, flag, value, message in BENCH_FLAGS
]


@pytest.mark.parametrize("mistake", KVPOOL, ids=str)
def test_kvpool(mistake: Mistake, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    refuse(cli.main, mistake, tmp_path, capsys)


@pytest.mark.process
@pytest.mark.parametrize(
    ("script", "mistake"), [("kvpool-agent", AGENT[0]), ("kvpool", KVPOOL[4])], ids=str
)
def test_the_scripts_refuse_in_one_line(script: str, mistake: Mistake, tmp_path: Path) -> None:
    feed(f"{BIN}/{script}", mistake, tmp_path)
