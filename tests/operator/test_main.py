"""The ``kvpool-operator`` command line: its tables of mistakes through ``main(argv)``, and
as a process, a row of each and what only a process shows (ports held)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.operator.main import main
from tests.support.mistakes import BIN, Mistake, feed, held_port, refuse


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--namespace", "x"], "--agent-image or $KVPOOL_AGENT_IMAGE is required"),
        (["--agent-image", "kvpool:1"], "one of the arguments -n/--namespace -A/--all-namespaces"),
        (["-A", "-n", "x", "--agent-image", "i"], "not allowed with argument"),
    ],
)
def test_refuses_an_incomplete_command_line(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVPOOL_AGENT_IMAGE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


IMAGE = ["-A", "--agent-image", "kvpool:1"]

OPERATOR = [
    Mistake(
        "no-scope",
        ["--agent-image", "kvpool:1"],
        ["kvpool-operator: one of the arguments -n/--namespace -A/--all-namespaces is required"],
    ),
    Mistake(
        "no-image", ["-A"], ["kvpool-operator: --agent-image or $KVPOOL_AGENT_IMAGE is required"]
    ),
    Mistake(
        "both-scopes",
        [*IMAGE, "-n", "x"],
        ["kvpool-operator: argument -n/--namespace: not allowed with argument -A/--all-namespaces"],
    ),
    Mistake(
        "retry-seconds",
        [*IMAGE, "--retry-seconds", "-1"],
        ["kvpool-operator: argument --retry-seconds: expected a number above 0, not -1"],
    ),
    Mistake(
        "usage-seconds",
        [*IMAGE, "--usage-seconds", "soon"],
        ["kvpool-operator: argument --usage-seconds: expected a number, not 'soon'"],
    ),
    Mistake(
        "clear-retries",
        [*IMAGE, "--clear-retries", "1.5"],
        ["kvpool-operator: argument --clear-retries: expected a whole number, not '1.5'"],
    ),
    Mistake(
        "liveness",
        [*IMAGE, "--liveness", "0.0.0.0:8080"],
        [
            "kvpool-operator: argument --liveness: expected http://HOST:PORT/PATH, "
            "not '0.0.0.0:8080'"
        ],
    ),
    Mistake(
        "log-format",
        [*IMAGE, "--log-format", "xml"],
        ["kvpool-operator: argument --log-format: invalid choice: 'xml'"],
    ),
    Mistake(
        "unknown-flag", [*IMAGE, "--frob"], ["kvpool-operator: unrecognized arguments: --frob"]
    ),
    Mistake(
        "webhook-flag-alone",
        [*IMAGE, "--webhook-port", "9443"],
        ["kvpool-operator: --webhook-port needs --webhook-url-host or --webhook-service"],
    ),
    Mistake(
        "webhook-both-ways",
        [*IMAGE, "--webhook-url-host", "h", "--webhook-service", "ns/op"],
        [
            "kvpool-operator: argument --webhook-service: not allowed with argument "
            "--webhook-url-host"
        ],
    ),
    Mistake(
        "webhook-service",
        [*IMAGE, "--webhook-service", "kvpool-operator"],
        [
            "kvpool-operator: argument --webhook-service: expected NAMESPACE/NAME, "
            "not 'kvpool-operator'"
        ],
    ),
    Mistake(
        "webhook-url-host",
        [*IMAGE, "--webhook-url-host", "https://h:9443"],
        [
            "kvpool-operator: argument --webhook-url-host: expected a host name or an IP "
            "address, not 'https://h:9443'"
        ],
    ),
    Mistake(
        "webhook-service-port-alone",
        [*IMAGE, "--webhook-url-host", "h", "--webhook-service-port", "443"],
        ["kvpool-operator: --webhook-service-port needs --webhook-service"],
    ),
    Mistake(
        "webhook-port",
        [*IMAGE, "--webhook-url-host", "h", "--webhook-port", "70000"],
        ["kvpool-operator: argument --webhook-port: expected a port (1 to 65535), not 70000"],
    ),
    Mistake(
        "webhook-configuration",
        [*IMAGE, "--webhook-url-host", "h", "--webhook-configuration", "kvpool"],
        [
            "kvpool-operator: argument --webhook-configuration: expected a DNS name with a dot "
            "(e.g. kvpool-operator.kvpool.io), not 'kvpool'"
        ],
    ),
]


KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "http://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""
"""Credentials for an API server that does not answer: not a mistake (kopf retries)."""

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")

CREDENTIALS = [
    Mistake(
        "no-kubeconfig",
        IMAGE,
        [
            "kvpool-operator: KUBECONFIG={tmp}/absent: no Kubernetes credentials: "
            "Invalid kube-config file. No configuration found."
        ],
        env={"KUBECONFIG": "{tmp}/absent"},
    ),
    Mistake(
        "no-kubeconfig-at-home",
        IMAGE,
        [
            "kvpool-operator: KUBECONFIG (not set: ~/.kube/config): no Kubernetes credentials: "
            "Invalid kube-config file. No configuration found."
        ],
    ),
    Mistake(
        "kubeconfig-yaml",
        IMAGE,
        [
            "kvpool-operator: KUBECONFIG={tmp}/kubeconfig: no Kubernetes credentials: "
            "not YAML: line 2, column 1: "
        ],
        env={"KUBECONFIG": "{tmp}/kubeconfig"},
        files={"kubeconfig": "clusters: [\n"},
    ),
    pytest.param(
        Mistake(
            "no-service-account",
            IMAGE,
            [
                "kvpool-operator: in-cluster service account (KUBERNETES_SERVICE_HOST=10.0.0.1): "
                "no Kubernetes credentials: Service token file does not exist."
            ],
            env={"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"},
        ),
        marks=pytest.mark.skipif(SERVICE_ACCOUNT.exists(), reason="runs in a pod"),
        id="no-service-account",
    ),
    Mistake(
        "liveness-host",
        [*IMAGE, "--liveness", "http://host.invalid:8080/healthz"],
        ["kvpool-operator: cannot listen on host.invalid:8080 (host, --liveness): "],
        env={"KUBECONFIG": "{tmp}/kubeconfig"},
        files={"kubeconfig": KUBECONFIG},
    ),
]


@pytest.mark.parametrize("mistake", OPERATOR, ids=str)
def test_broken_command_lines_are_one_line_each(
    mistake: Mistake, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    refuse(main, mistake, tmp_path, capsys)


@pytest.mark.parametrize("mistake", CREDENTIALS, ids=str)
def test_what_kopf_would_retry_forever_is_one_line(
    mistake: Mistake, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No credentials at all, or a liveness address the host lacks: refused before kopf
    runs (which would log a traceback and retry every minute)."""
    refuse(main, mistake, tmp_path, capsys)


@pytest.mark.process
@pytest.mark.parametrize("mistake", [OPERATOR[3], CREDENTIALS[0]], ids=str)
def test_the_script_refuses_in_one_line(mistake: Mistake, tmp_path: Path) -> None:
    feed(f"{BIN}/kvpool-operator", mistake, tmp_path)


@pytest.mark.process
def test_liveness_port_in_use(tmp_path: Path) -> None:
    mistake = Mistake(
        "liveness-port",
        [*IMAGE, "--liveness", "http://127.0.0.1:{port}/healthz"],
        ["kvpool-operator: port {port} (--liveness) is in use on 127.0.0.1"],
        env={"KUBECONFIG": "{tmp}/kubeconfig"},
        files={"kubeconfig": KUBECONFIG},
    )
    with held_port() as port:
        feed(f"{BIN}/kvpool-operator", mistake, tmp_path, port=port)


WEBHOOK = [*IMAGE, "--liveness", "http://127.0.0.1:0/healthz", "--webhook-url-host", "127.0.0.1"]


@pytest.mark.process
def test_webhook_port_in_use(tmp_path: Path) -> None:
    mistake = Mistake(
        "webhook-port-in-use",
        [*WEBHOOK, "--webhook-bind", "127.0.0.1", "--webhook-port", "{port}"],
        ["kvpool-operator: port {port} (--webhook-port) is in use on 127.0.0.1"],
        env={"KUBECONFIG": "{tmp}/kubeconfig"},
        files={"kubeconfig": KUBECONFIG},
    )
    with held_port() as port:
        feed(f"{BIN}/kvpool-operator", mistake, tmp_path, port=port)


@pytest.mark.process
def test_webhook_certificate_directory_without_its_files(tmp_path: Path) -> None:
    mistake = Mistake(
        "webhook-cert-dir",
        [*WEBHOOK, "--webhook-cert-dir", "{tmp}"],
        ["kvpool-operator: --webhook-cert-dir {tmp}: no tls.crt or tls.key in it"],
        env={"KUBECONFIG": "{tmp}/kubeconfig"},
        files={"kubeconfig": KUBECONFIG},
    )
    feed(f"{BIN}/kvpool-operator", mistake, tmp_path)
