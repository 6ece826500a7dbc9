"""A refused configuration in one line per problem, named where the user wrote it."""

from __future__ import annotations

import errno
import socket
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from kvpool.common.config import AgentConfig, load_settings
from kvpool.common.problems import (
    ConfigError,
    EnvironmentOrigin,
    FlagOrigin,
    MappingOrigin,
    Origin,
    describe,
    listening,
    show,
)


def problems(values: dict[str, object], *origins: Origin) -> list[str]:
    with pytest.raises(ValidationError) as refused:
        AgentConfig(**values)
    return describe(refused.value, origins, AgentConfig)


def test_a_value_is_named_where_it_was_set_highest_precedence_first() -> None:
    values = {"zmq_port": "x"}
    env = EnvironmentOrigin("KVPOOL_", "__", {"kvpool_zmq_port": "x"})
    file = MappingOrigin("agent.yaml", {"zmq_port": "y"})
    flags = FlagOrigin({("zmq_port",): ("--zmq-port", "x")})
    assert problems(values, env, file)[0].startswith("kvpool_zmq_port=x: input should be")
    assert problems(values, file, env)[0].startswith("agent.yaml: zmq_port=y: input should be")
    assert problems(values, flags, env)[0].startswith("--zmq-port x: input should be")
    assert problems(values)[0].startswith("zmq_port=x: input should be")  # nowhere known


def test_nested_settings_and_json_variables() -> None:
    env = EnvironmentOrigin("KVPOOL_", "__", {"KVPOOL_NVME": '{"path": "/x", "capacity": "1GB"}'})
    (line,) = problems({"nvme": {"path": "/x", "capacity": "1GB"}}, env)
    assert line.startswith("KVPOOL_NVME.capacity=1GB: ambiguous unit GB")
    file = MappingOrigin("agent.yaml", {"nvme": {"path": "/x"}})
    assert problems({"nvme": {"path": "/x"}}, file) == [
        "agent.yaml: nvme.capacity: required, not set"
    ]


def test_unknown_keys_get_the_nearest_known_one() -> None:
    file = MappingOrigin("a.yaml", {"l1": {"size": "1Gi"}, "evictoin_policy": "lru", "zzz": 1})
    lines = problems({"l1": {"size": "1Gi"}, "evictoin_policy": "lru", "zzz": 1}, file)
    assert lines[0] == 'a.yaml: l1={"size": "1Gi"}: unknown setting; did you mean l1_size?'
    assert lines[1] == "a.yaml: evictoin_policy=lru: unknown setting; did you mean eviction_policy?"
    assert lines[2].startswith(
        "a.yaml: zzz=1: unknown setting; known: default_pin_budget, default_tenant_quota, "
    )


def test_a_rule_over_several_fields_names_those_the_user_set() -> None:
    env = EnvironmentOrigin("KVPOOL_", "__", {"KVPOOL_LOW_WATERMARK": "0.95"})
    assert problems({"low_watermark": 0.95}, env) == [
        "KVPOOL_LOW_WATERMARK=0.95: low_watermark (0.95) must be below high_watermark (0.9)"
    ]
    assert problems({"page_size": 5000}) == [
        "page_size=5000 (default): page_size must be a power of two >= 4096, got 5000"
    ]


def test_values_are_shown_short_and_as_written() -> None:
    assert show("64Mi") == "64Mi"
    assert show(Path("/etc/kvpool/agent.yaml")) == "/etc/kvpool/agent.yaml"
    assert show("two words") == '"two words"'
    assert show("") == '""'
    assert show({"size": "64Mi"}) == '{"size": "64Mi"}'
    assert show(list(range(100))).endswith("...") and len(show(list(range(100)))) == 80


def test_load_settings_reads_the_file_once_more_to_name_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = tmp_path / "agent.yaml"
    file.write_text("l1_size: 1GB\nhigh_watermark: 2\n")
    monkeypatch.setenv("KVPOOL_CONFIG_FILE", str(file))
    with pytest.raises(ConfigError) as refused:
        load_settings(AgentConfig)
    assert [line.split(":")[1] for line in refused.value.problems] == [
        " l1_size=1GB",
        " high_watermark=2",
    ]


def test_a_bound_port_is_one_line_naming_the_setting() -> None:
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        with pytest.raises(ConfigError) as refused, listening("zmq_port", "127.0.0.1", port):
            socket.create_server(("127.0.0.1", port))
    assert refused.value.problems == [f"port {port} (zmq_port) is in use on 127.0.0.1"]
    unavailable = r"cannot listen on 10\.255\.0\.1:1 \(host, http_port\)"
    with pytest.raises(ConfigError, match=unavailable), listening("http_port", "10.255.0.1", 1):
        raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")
    with pytest.raises(RuntimeError), listening("http_port", "h", 1):
        raise RuntimeError("not a bind error")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
    count: int


def test_describe_works_for_any_model() -> None:
    with pytest.raises(ValidationError) as refused:
        _Strict.model_validate({"count": "x", "cuont": 1})
    origin = MappingOrigin("kv_connector_extra_config", {"count": "x", "cuont": 1})
    assert describe(refused.value, [origin], _Strict) == [
        "kv_connector_extra_config: count=x: input should be a valid integer, unable to parse "
        "string as an integer",
        "kv_connector_extra_config: cuont=1: unknown setting; did you mean count?",
    ]
