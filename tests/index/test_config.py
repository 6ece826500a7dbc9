"""The index configuration: sources and their precedence, validation, the process's refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from kvpool.common.index_config import IndexConfig, StaticAgent
from kvpool.common.kube.discovery import AgentEndpoint, KubernetesDiscovery
from kvpool.common.routing import RoutingPolicy
from kvpool.index.server import main, make_discovery

AGENT = {"node": "gpu-1", "zmq": "tcp://10.0.0.5:7400", "events": "tcp://10.0.0.5:7402"}


def test_file_then_environment_then_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_file = tmp_path / "index.yaml"
    config_file.write_text(
        yaml.safe_dump(
            {
                "pool": "main",
                "agents": [AGENT],
                "load_factor": 2.0,
                "min_match_ratio": 0.5,
                "fingerprint": {"model": "m", "dtype": "bf16", "kv_layout": "NHD"},
            }
        )
    )
    monkeypatch.setenv("KVPOOL_INDEX_CONFIG_FILE", str(config_file))
    monkeypatch.setenv("KVPOOL_INDEX_MIN_MATCH_RATIO", "0.1")
    config = IndexConfig()
    assert (config.pool, config.discovery, config.load_factor) == ("main", "static", 2.0)
    assert config.routing_policy() == RoutingPolicy(2.0, 0.1, 0.0)
    assert config.fingerprint is not None and config.fingerprint.fingerprint().chunk_tokens == 256
    assert config.generated_token_file == config.state_dir / "index-admin-token-main"
    discovery = make_discovery(config)
    assert discovery.endpoints == [AgentEndpoint(**AGENT)]  # type: ignore[attr-defined]
    other = StaticAgent(node="gpu-2", zmq="tcp://b:7400", events="tcp://b:7402")
    assert IndexConfig(agents=[other]).agents == [other]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({}, "static discovery needs agents"),
        ({"agents": [AGENT, AGENT]}, "each node may be listed once"),
        ({"agents": [AGENT], "pool": "Not_A_Label"}, "pool"),
        ({"agents": [AGENT], "load_factor": 0.5}, "load_factor"),
        ({"discovery": "consul"}, "discovery"),
    ],
)
def test_invalid_settings_name_the_field(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        IndexConfig(**settings)  # type: ignore[arg-type]


def test_kubernetes_discovery_needs_an_api_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="no Kubernetes API"):
        KubernetesDiscovery.connect("main", "kvpool")
    with pytest.raises(ValueError, match="no Kubernetes API"):
        make_discovery(IndexConfig(discovery="kubernetes"))


def test_kvpool_index_refuses_a_bad_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["--agent", "nonsense"]) == 2
    assert "NODE=ZMQ_ENDPOINT,EVENTS_ENDPOINT" in capsys.readouterr().err
    assert main([]) == 2
    assert "static discovery needs agents" in capsys.readouterr().err
    bad_tokens = tmp_path / "tokens.yaml"
    bad_tokens.write_text("gateways: [1]\n")
    monkeypatch.setenv("KVPOOL_INDEX_TOKENS_FILE", str(bad_tokens))
    assert main(["--agent", "n=tcp://127.0.0.1:1,tcp://127.0.0.1:2"]) == 2
    assert "gateways: token #1" in capsys.readouterr().err
