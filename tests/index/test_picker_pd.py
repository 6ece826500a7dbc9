"""Prefill/decode disaggregation in the endpoint picker: servers' roles, the decision (the
uncached part against the threshold, the prefill pods' queues, the decode pod by load and
node), its outcomes counted, and the key the index starts with.

Pickers are real :class:`EndpointPicker` s over real :class:`ServerState` s and trackers
filled with the connector's keys, as in ``test_picker``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from kvpool.common.index_config import (
    IndexConfig,
    ModelServer,
    PickerConfig,
    PrefillDecode,
    ServerRole,
)
from kvpool.common.problems import ConfigError
from kvpool.index.endpoint_picker import EndpointPickerService
from kvpool.index.metrics import IndexMetrics
from kvpool.index.model_servers import ModelServers, ServerState, discovery_of, server_of
from kvpool.index.picker import EndpointPicker, Tiers
from kvpool.index.picking import Disaggregation, Pick, PickReason, PickRequest, PrefillPod
from kvpool.index.tracker import PrefixTracker
from tests.index.test_model_servers import model_pod
from tests.index.test_picker import CHUNK, COSTS, FINGERPRINT, Decisions, prompt, server, store

PD = PrefillDecode(enabled=True, threshold_tokens=512, max_prefill_waiting=2, key_file=Path("k"))
LONG = 2048
"""Tokens of a long prompt: 128 chunks."""


def role(state: ServerState, role: ServerRole) -> ServerState:
    return replace(state, role=role)


def pd_picker(
    servers: Sequence[ServerState],
    tiers: Tiers | None = None,
    pd: PrefillDecode = PD,
    observer: Decisions | None = None,
) -> EndpointPicker:
    return EndpointPicker(
        lambda: servers,
        tiers or Tiers(l1=PrefixTracker()),
        FINGERPRINT,
        COSTS,
        deadline_ms=2000.0,
        pd=pd,
        observer=observer,
    )


# -------------------------------------------------------------------------------- roles


def labelled(name: str, **labels: str) -> dict[str, Any]:
    pod = model_pod(name)
    pod["metadata"]["labels"] = labels
    return pod


def test_roles_come_from_kvpools_label_or_llm_ds(caplog: pytest.LogCaptureFixture) -> None:
    def role_of(**labels: str) -> str:
        found = server_of(labelled("vllm-0", **labels), 8000)
        assert found is not None
        return found.role

    assert role_of() == "both"
    assert role_of(**{"kvpool.io/role": "prefill"}) == "prefill"
    assert role_of(**{"kvpool.io/role": "decode", "llm-d.ai/role": "prefill"}) == "decode"
    assert role_of(**{"llm-d.ai/role": "decode"}) == "decode"
    assert role_of(**{"llm-d.ai/role": "prefill-decode"}) == "both"
    assert role_of(**{"llm-d.ai/role": "both"}) == "both"
    with caplog.at_level(logging.WARNING, logger="kvpool.index.model_servers"):
        assert role_of(**{"kvpool.io/role": "prefil"}) == "both"
    warned = [r.getMessage() for r in caplog.records]
    assert any("vllm-0" in line and "kvpool.io/role=prefil" in line for line in warned)


def test_a_static_servers_role_reaches_the_picker_and_is_validated() -> None:
    config = PickerConfig(
        servers=[
            ModelServer(address="127.0.0.1:1", node="n1", role="prefill"),
            ModelServer(address="127.0.0.1:2", node="n2"),
        ]
    )
    servers = ModelServers(discovery_of(config, None), interval=60, timeout=0.2)
    servers.start()
    try:
        assert [(s.address, s.role) for s in servers.snapshot()] == [
            ("127.0.0.1:1", "prefill"),
            ("127.0.0.1:2", "both"),
        ]
    finally:
        servers.stop()
    with pytest.raises(ValidationError, match="role"):
        ModelServer(address="127.0.0.1:1", node="n1", role="prefiller")
    with pytest.raises(ValidationError, match="key_file"):
        PrefillDecode(enabled=True)


# ---------------------------------------------------------------------------- the decision


def test_a_long_uncached_prompt_is_disaggregated_and_a_short_one_is_not() -> None:
    decisions = Decisions()
    servers = [
        role(server("10.0.0.1:8000", "n1"), "decode"),
        role(server("10.0.0.2:8000", "n2"), "prefill"),
    ]
    picker = pd_picker(servers, observer=decisions)
    long = picker.pick(PickRequest(prompt(LONG), "t"))
    assert long == Pick("10.0.0.1:8000", PickReason.PD, 0, PrefillPod("10.0.0.2:8000", "n2"))
    short = picker.pick(PickRequest(prompt(511, seed=1), "t"))
    assert short == Pick("10.0.0.1:8000", PickReason.LOAD)
    off = pd_picker(servers, pd=PrefillDecode(), observer=decisions)
    assert off.pick(PickRequest(prompt(LONG, seed=2), "t")).prefill is None
    assert decisions.disaggregations == [
        Disaggregation.DISAGGREGATED,
        Disaggregation.SHORT,
        Disaggregation.DISABLED,
    ]


def test_what_the_decode_pod_can_load_is_not_counted_against_the_threshold() -> None:
    l1 = PrefixTracker()
    tokens = prompt(LONG)
    store(l1, "n1", tokens, "t", (LONG - 256) // CHUNK)  # all but 256 tokens on d's node
    servers = [
        role(server("10.0.0.1:8000", "n1"), "decode"),
        role(server("10.0.0.2:8000", "n2"), "prefill"),
    ]
    assert pd_picker(servers, Tiers(l1=l1)).pick(PickRequest(tokens, "t")) == Pick(
        "10.0.0.1:8000", PickReason.PREFIX, LONG - 256
    )
    # another tenant's identical prompt matches nothing: all of it is uncached
    assert pd_picker(servers, Tiers(l1=l1)).pick(PickRequest(tokens, "u")).reason == PickReason.PD


def test_the_prefill_pod_is_the_lowest_estimate_and_the_decode_pod_the_least_loaded() -> None:
    l1 = PrefixTracker()
    tokens = prompt(LONG)
    store(l1, "n4", tokens, "t", 512 // CHUNK)  # p2's node holds the first 512 tokens
    servers = [
        role(server("10.0.0.1:8000", "n1", running=4), "decode"),
        role(server("10.0.0.2:8000", "n2"), "decode"),
        role(server("10.0.0.3:8000", "n3"), "prefill"),
        role(server("10.0.0.4:8000", "n4"), "prefill"),
        role(server("10.0.0.5:8000", "n4", waiting=1), "prefill"),
    ]
    picked = pd_picker(servers, Tiers(l1=l1)).pick(PickRequest(tokens, "t"))
    # 10.0.0.4 loads 512 tokens from its L1, 10.0.0.3 fetches them from n4 as a peer (a
    # little slower), 10.0.0.5 waits for another prefill first; the decode pod is the idle
    # one (d itself here: the decoders hold nothing)
    assert picked == Pick("10.0.0.2:8000", PickReason.PD, 512, PrefillPod("10.0.0.4:8000", "n4"))


def test_a_busy_or_missing_prefill_pod_keeps_the_request_whole() -> None:
    decisions = Decisions()
    decode = role(server("10.0.0.1:8000", "n1"), "decode")
    busy = role(server("10.0.0.2:8000", "n2", waiting=3), "prefill")  # more than 2 waiting
    unready = role(ServerState("10.0.0.3:8000", "n3"), "prefill")
    request = PickRequest(prompt(LONG), "t")
    assert pd_picker([decode, busy, unready], observer=decisions).pick(request) == Pick(
        "10.0.0.1:8000", PickReason.LOAD
    )
    assert pd_picker([decode, unready], observer=decisions).pick(request).prefill is None
    # a decode-only pool: nothing prefills for another
    other = role(server("10.0.0.4:8000", "n4"), "decode")
    assert pd_picker([decode, other], observer=decisions).pick(request).prefill is None
    assert decisions.disaggregations == [
        Disaggregation.PREFILL_BUSY,
        Disaggregation.NO_PREFILL_READY,
        Disaggregation.NO_PREFILL_READY,
    ]


def test_a_prefill_server_never_takes_a_whole_request_while_a_decoder_is_ready() -> None:
    l1 = PrefixTracker()
    tokens = prompt(LONG)
    store(l1, "n2", tokens, "t", LONG // CHUNK)  # all of it on the prefill server's node
    prefill = role(server("10.0.0.2:8000", "n2"), "prefill")
    decode = role(server("10.0.0.1:8000", "n1", waiting=50), "decode")
    request = PickRequest(tokens, "t")
    for pd in (PrefillDecode(), PD):  # short for the decoder too: it loads it as a peer
        picked = pd_picker([decode, prefill], Tiers(l1=l1), pd).pick(request)
        assert picked == Pick("10.0.0.1:8000", PickReason.PREFIX, LONG)
    # no decoder ready: the prefill server takes it whole (never a 503 for that reason)
    decisions = Decisions()
    unready = role(ServerState("10.0.0.1:8000", "n1"), "decode")
    whole = pd_picker([unready, prefill], observer=decisions).pick(PickRequest(prompt(LONG), "u"))
    assert whole == Pick("10.0.0.2:8000", PickReason.LOAD)
    assert decisions.disaggregations == [Disaggregation.NO_DECODE_READY]


def test_both_roles_and_the_prefill_pods_node_among_equal_decode_pods() -> None:
    request = PickRequest(prompt(LONG), "t")
    both = [server("10.0.0.1:8000", "n1"), server("10.0.0.2:8000", "n2")]
    # d is the first by address; p the other; the decode pod the least loaded but p
    assert pd_picker(both).pick(request) == Pick(
        "10.0.0.1:8000", PickReason.PD, 0, PrefillPod("10.0.0.2:8000", "n2")
    )
    tied = [
        role(server("10.0.0.1:8000", "n1"), "decode"),
        role(server("10.0.0.2:8000", "n2"), "decode"),
        role(server("10.0.0.3:8000", "n2"), "prefill"),
    ]
    # 10.0.0.1 would win the tie by address; 10.0.0.2 shares the prefill pod's node
    assert pd_picker(tied).pick(request).endpoint == "10.0.0.2:8000"
    loaded = [tied[0], role(server("10.0.0.2:8000", "n2", running=1), "decode"), tied[2]]
    assert pd_picker(loaded).pick(request).endpoint == "10.0.0.1:8000"  # load before node


# ------------------------------------------------------------------------ metrics, the key


def test_disaggregation_outcomes_are_counted() -> None:
    metrics = IndexMetrics(CollectorRegistry(), PrefixTracker(), lambda: [])
    metrics.register_picker(dict, tuple)
    servers = [server("10.0.0.1:8000", "n1"), server("10.0.0.2:8000", "n2")]
    picker = pd_picker(servers, observer=metrics)  # type: ignore[arg-type]
    picker.pick(PickRequest(prompt(LONG), "t"))
    picker.pick(PickRequest(prompt(64), "t"))
    text = metrics.exposition()[0].decode()
    assert 'kvpool_index_pick_disaggregation_total{outcome="disaggregated"} 1.0' in text
    assert 'kvpool_index_pick_disaggregation_total{outcome="short"} 1.0' in text
    assert 'kvpool_index_picks_total{reason="pd"} 1.0' in text


def test_a_bad_key_file_fails_the_start_naming_it(tmp_path: Path) -> None:
    short = tmp_path / "pd.key"
    short.write_text("too short\n")
    settings = {
        "agents": [{"node": "n1", "zmq": "tcp://127.0.0.1:1", "events": "tcp://127.0.0.1:2"}],
        "fingerprint": {"model": "m", "dtype": "bfloat16", "kv_layout": "layout"},
    }
    metrics = IndexMetrics(CollectorRegistry(), PrefixTracker(), lambda: [])
    for key_file in (short, tmp_path / "absent.key"):
        config = IndexConfig(
            **settings,  # type: ignore[arg-type]
            picker=PickerConfig(enabled=True, pd=PrefillDecode(enabled=True, key_file=key_file)),
        )
        with pytest.raises(ConfigError) as refused:
            EndpointPickerService(config, Tiers(), metrics)
        (line,) = refused.value.problems
        assert line.startswith("picker.pd.key_file: ") and str(key_file) in line
