from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from kvpool.common.names import CONNECTOR_OLD_NAMES
from kvpool.common.problems import ConfigError
from kvpool.common.protocol import PROTOCOL_VERSION
from kvpool.connector import discovery, identity
from kvpool.connector import settings as settings_module
from kvpool.connector.discovery import AgentAddress, DiscoveryError, resolve
from kvpool.connector.settings import ConnectorSettings

ANNOTATIONS = {
    "kvpool.io/zmq-port": "7400",
    "kvpool.io/segment-path": "/dev/shm/kvpool-main/segment",
    "kvpool.io/chunk-tokens": "512",
    "kvpool.io/protocol-version": str(PROTOCOL_VERSION),
}


def test_explicit_endpoint() -> None:
    settings = ConnectorSettings.load({"endpoint": "tcp://10.0.0.1:7400"}, environ={})
    assert resolve(settings) == AgentAddress("tcp://10.0.0.1:7400", None, None)


def test_exactly_one_target() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        ConnectorSettings.load({}, environ={})
    with pytest.raises(ValueError, match="exactly one of"):
        ConnectorSettings.load({"endpoint": "tcp://a:1", "pool": "main"}, environ={})


def test_unknown_key_names_the_known_ones() -> None:
    with pytest.raises(
        ValueError, match="chunk_size=256: unknown setting; did you mean chunk_tokens"
    ):
        ConnectorSettings.load({"endpoint": "tcp://a:1", "chunk_size": 256}, environ={})
    with pytest.raises(ValueError, match="known: chunk_tokens, decode_wait_s, door_path, endpoint"):
        ConnectorSettings.load({"endpoint": "tcp://a:1", "zzz": 1}, environ={})


def test_each_problem_is_one_line_naming_the_key_or_variable() -> None:
    with pytest.raises(ConfigError) as refused:
        ConnectorSettings.load(
            {"endpoint": "tcp://a:1", "chunk_tokens": 0, "lookup_timeout_s": "soon"},
            environ={"KVPOOL_CONNECTOR_ENDPOINT": "localhost:7400"},
        )
    assert refused.value.problems == [
        "KVPOOL_CONNECTOR_ENDPOINT=localhost:7400: must be tcp://host:port or ipc://path; "
        "did you mean tcp://localhost:7400?",
        "kv_connector_extra_config: chunk_tokens=0: input should be greater than 0",
        "kv_connector_extra_config: lookup_timeout_s=soon: input should be a valid number, "
        "unable to parse string as a number",
    ]


def test_bad_values_are_refused() -> None:
    with pytest.raises(ValueError, match="tcp://host:port"):
        ConnectorSettings.load({"endpoint": "localhost:7400"}, environ={})
    with pytest.raises(ValueError, match="chunk_tokens"):
        ConnectorSettings.load({"endpoint": "tcp://a:1", "chunk_tokens": 0}, environ={})


def test_in_an_engine_a_malformed_endpoint_is_one_line_not_a_refusal() -> None:
    settings, why = ConnectorSettings.for_engine(
        {"endpoint": "127.0.0.1:7400", "chunk_tokens": "512"}, environ={}
    )
    assert why == (
        "kv_connector_extra_config: endpoint=127.0.0.1:7400: must be tcp://host:port or "
        "ipc://path; did you mean tcp://127.0.0.1:7400? (vLLM goes on without the cache)"
    )
    assert settings.endpoint is None and settings.pool is None
    assert settings.chunk_tokens == 512  # the others validated as ever
    _, why = ConnectorSettings.for_engine(
        {"pool": "main"}, environ={"KVPOOL_CONNECTOR_ENDPOINT": "ftp://agent:7400"}
    )
    assert why == (
        "KVPOOL_CONNECTOR_ENDPOINT=ftp://agent:7400: must be tcp://host:port or ipc://path "
        "(vLLM goes on without the cache)"
    )


def test_in_an_engine_other_mistakes_still_refuse() -> None:
    good, why = ConnectorSettings.for_engine({"endpoint": "tcp://a:1"}, environ={})
    assert why is None and good.endpoint == "tcp://a:1"
    with pytest.raises(ConfigError) as refused:  # malformed, and another mistake
        ConnectorSettings.for_engine({"endpoint": "a:1", "chunk_tokens": 0}, environ={})
    assert len(refused.value.problems) == 2
    with pytest.raises(ConfigError, match="exactly one of"):
        ConnectorSettings.for_engine({}, environ={})
    with pytest.raises(ConfigError, match="tcp://host:port"):  # elsewhere: refused, as ever
        ConnectorSettings.load({"endpoint": "a:1"}, environ={})


def test_environment_overrides_everything() -> None:
    environ = {
        "KVPOOL_CONNECTOR_ENDPOINT": "tcp://127.0.0.1:9000",
        "KVPOOL_CONNECTOR_SEGMENT_PATH": "/dev/shm/mine",
        "KVPOOL_CONNECTOR_CHUNK_TOKENS": "128",
    }
    settings = ConnectorSettings.load({"pool": "main", "namespace": "ns"}, environ=environ)
    assert resolve(settings) == AgentAddress("tcp://127.0.0.1:9000", Path("/dev/shm/mine"), 128)


NEW_NAMES = {
    "KVPOOL_CONNECTOR_ENDPOINT": "tcp://127.0.0.1:9000",
    "KVPOOL_CONNECTOR_SEGMENT_PATH": "/var/run/kvpool/segment",
    "KVPOOL_CONNECTOR_CHUNK_TOKENS": "128",
    "KVPOOL_CONNECTOR_TRANSPORT": "messages",
    "KVPOOL_CONNECTOR_DOOR_PATH": "/var/run/kvpool/segment.door/agent.sock",
    "KVPOOL_CONNECTOR_TOKEN": "the-team-s-token",
}
"""Every connector variable (but the token file, which the token beats) by its new name."""
OLD_NAMES = {
    name.replace("KVPOOL_CONNECTOR_", "KVPOOL_"): value for name, value in NEW_NAMES.items()
}
SETTINGS_LOG = "kvpool.connector.settings"


@pytest.fixture
def new_process(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """As in a process that has read no old name yet, with the connector's lines captured."""
    monkeypatch.setattr(settings_module, "_warned", set())
    caplog.set_level(logging.WARNING, logger=SETTINGS_LOG)


def _as_the_engine_builds_it(environ: dict[str, str]) -> tuple[ConnectorSettings, str]:
    """What ``KvpoolConnector.__init__`` reads: its settings and its token."""
    settings, no_agent = ConnectorSettings.for_engine({"pool": "main"}, environ)
    assert no_agent is None
    return settings, identity.credential(settings, environ)()


def _read_as_expected(settings: ConnectorSettings, token: str) -> None:
    assert resolve(settings) == AgentAddress(
        "tcp://127.0.0.1:9000",
        Path("/var/run/kvpool/segment"),
        128,
        "messages",
        Path("/var/run/kvpool/segment.door/agent.sock"),
    )
    assert (settings.pool, token) == (None, "the-team-s-token")  # the endpoint beats the pool


@pytest.mark.usefixtures("new_process")
def test_the_new_names_override_without_a_word(caplog: pytest.LogCaptureFixture) -> None:
    _read_as_expected(*_as_the_engine_builds_it(NEW_NAMES))
    # both names, one value: as the webhook writes them for connectors of either age
    _read_as_expected(*_as_the_engine_builds_it({**NEW_NAMES, **OLD_NAMES}))
    assert caplog.records == []


@pytest.mark.usefixtures("new_process")
def test_the_old_names_are_read_with_one_warning_per_process(
    caplog: pytest.LogCaptureFixture,
) -> None:
    for _ in ("scheduler", "worker"):  # both connectors of an engine in one process
        _read_as_expected(*_as_the_engine_builds_it(OLD_NAMES))
    assert [record.getMessage() for record in caplog.records] == [
        "kvpool: deprecated variable names, read for now: "
        "KVPOOL_ENDPOINT -> KVPOOL_CONNECTOR_ENDPOINT, "
        "KVPOOL_SEGMENT_PATH -> KVPOOL_CONNECTOR_SEGMENT_PATH, "
        "KVPOOL_CHUNK_TOKENS -> KVPOOL_CONNECTOR_CHUNK_TOKENS, "
        "KVPOOL_TRANSPORT -> KVPOOL_CONNECTOR_TRANSPORT, "
        "KVPOOL_DOOR_PATH -> KVPOOL_CONNECTOR_DOOR_PATH, "
        "KVPOOL_TOKEN -> KVPOOL_CONNECTOR_TOKEN; set the new ones"
    ]
    assert set(OLD_NAMES) == set(CONNECTOR_OLD_NAMES.values()) - {"KVPOOL_TOKEN_FILE"}
    with pytest.raises(ConfigError) as refused:  # a mistake names the variable as set
        ConnectorSettings.load({}, {**OLD_NAMES, "KVPOOL_CHUNK_TOKENS": "many"})
    assert refused.value.problems == [
        "KVPOOL_CHUNK_TOKENS=many: input should be a valid integer, unable to parse string as "
        "an integer"
    ]


@pytest.mark.usefixtures("new_process")
def test_both_names_with_different_values_are_refused(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError) as refused:
        ConnectorSettings.for_engine(
            {"pool": "main"}, {**NEW_NAMES, "KVPOOL_ENDPOINT": "tcp://elsewhere:7400"}
        )
    assert refused.value.problems == [
        "KVPOOL_CONNECTOR_ENDPOINT=tcp://127.0.0.1:9000 and KVPOOL_ENDPOINT=tcp://elsewhere:7400 "
        "(its old name) differ: set KVPOOL_CONNECTOR_ENDPOINT only"
    ]
    with pytest.raises(ConfigError) as refused:  # a token's values are not shown
        ConnectorSettings.for_engine({"pool": "main"}, {**NEW_NAMES, "KVPOOL_TOKEN": "another"})
    assert refused.value.problems == [
        "KVPOOL_CONNECTOR_TOKEN and KVPOOL_TOKEN (its old name) differ: set "
        "KVPOOL_CONNECTOR_TOKEN only"
    ]
    settings = ConnectorSettings.load({"endpoint": "tcp://a:1"}, {})
    with pytest.raises(
        ConfigError, match=r"^KVPOOL_CONNECTOR_TOKEN_FILE=/a and KVPOOL_TOKEN_FILE=/b \(its"
    ):
        identity.credential(
            settings, {"KVPOOL_CONNECTOR_TOKEN_FILE": "/a", "KVPOOL_TOKEN_FILE": "/b"}
        )
    assert caplog.records == []


def test_pool_is_discovered_through_the_service() -> None:
    asked: list[tuple[str, str]] = []

    def read(name: str, namespace: str) -> dict[str, str]:
        asked.append((name, namespace))
        return ANNOTATIONS

    settings = ConnectorSettings.load({"pool": "main", "namespace": "inference"}, environ={})
    address = resolve(settings, read)
    assert asked == [("kvpool-main", "inference")]
    assert address == AgentAddress(
        "tcp://kvpool-main.inference.svc:7400", Path("/dev/shm/kvpool-main/segment"), 512
    )


def test_settings_win_over_annotations() -> None:
    settings = ConnectorSettings.load(
        {"pool": "main", "namespace": "ns", "chunk_tokens": 256, "segment_path": "/mnt/seg"},
        environ={},
    )
    address = resolve(settings, lambda name, namespace: ANNOTATIONS)
    assert (address.chunk_tokens, address.segment_path) == (256, Path("/mnt/seg"))


def test_namespace_defaults_to_the_pods_own(tmp_path: Path) -> None:
    namespace_file = tmp_path / "namespace"
    namespace_file.write_text("serving\n")
    settings = ConnectorSettings.load({"pool": "main"}, environ={})
    address = resolve(settings, lambda name, namespace: ANNOTATIONS, namespace_file)
    assert address.endpoint == "tcp://kvpool-main.serving.svc:7400"
    with pytest.raises(DiscoveryError, match="is this pod in Kubernetes"):
        resolve(settings, lambda name, namespace: ANNOTATIONS, tmp_path / "missing")


@pytest.mark.parametrize(
    ("annotations", "message"),
    [
        (
            {**ANNOTATIONS, "kvpool.io/protocol-version": str(PROTOCOL_VERSION + 1)},
            f"speaks protocol {PROTOCOL_VERSION + 1}",
        ),
        ({"kvpool.io/segment-path": "/dev/shm/x"}, "no kvpool.io/zmq-port"),
        ({**ANNOTATIONS, "kvpool.io/zmq-port": "http"}, "is not an integer"),
        ({**ANNOTATIONS, "kvpool.io/chunk-tokens": "-1"}, "must be positive"),
    ],
)
def test_unusable_annotations(annotations: dict[str, str], message: str) -> None:
    settings = ConnectorSettings.load({"pool": "main", "namespace": "ns"}, environ={})
    with pytest.raises(DiscoveryError, match=message):
        resolve(settings, lambda name, namespace: annotations)


def test_kubernetes_errors_become_discovery_errors() -> None:
    def forbidden(name: str, namespace: str) -> dict[str, str]:
        raise PermissionError("services is forbidden")

    settings = ConnectorSettings.load({"pool": "main", "namespace": "ns"}, environ={})
    with pytest.raises(
        DiscoveryError, match="cannot read Service ns/kvpool-main: services is"
    ) as e:
        resolve(settings, forbidden)
    assert "a pod labelled kvpool.io/cache-pool=main is given the agent's address" in str(e.value)


def test_the_kubernetes_reader_uses_the_in_cluster_account(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[object] = []

    class CoreV1Api:
        def read_namespaced_service(
            self, name: str, namespace: str, _request_timeout: float
        ) -> SimpleNamespace:
            calls.append((name, namespace, _request_timeout))
            return SimpleNamespace(metadata=SimpleNamespace(annotations=ANNOTATIONS))

    config = ModuleType("kubernetes.config")
    config.load_incluster_config = lambda: calls.append("in-cluster")  # type: ignore[attr-defined]
    client = ModuleType("kubernetes.client")
    client.CoreV1Api = CoreV1Api  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kubernetes", ModuleType("kubernetes"))
    monkeypatch.setitem(sys.modules, "kubernetes.config", config)
    monkeypatch.setitem(sys.modules, "kubernetes.client", client)

    settings = ConnectorSettings.load({"pool": "main", "namespace": "ns"}, environ={})
    address = resolve(settings)

    assert calls == ["in-cluster", ("kvpool-main", "ns", discovery.K8S_TIMEOUT_S)]
    assert address.endpoint == "tcp://kvpool-main.ns.svc:7400"
