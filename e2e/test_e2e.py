"""kubectl apply to a KV hit in vLLM: one test of the whole flow (``scenario.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from .scenario import MANIFESTS, SPACE, TEAMS, Evidence, Unavailable, run

pytestmark = [pytest.mark.process, pytest.mark.engine, pytest.mark.root, pytest.mark.netns]

DOOR = "/var/run/kvpool/agent.sock"
"""The agent's door in a tenant's pod (the volume holds the door's directory only)."""


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_the_whole_flow(tmp_path: Path) -> None:
    try:
        evidence = run(tmp_path, say=print)
    except Unavailable as error:
        pytest.skip(str(error))

    # one kubectl apply per team: a Secret with a generated salt and a minted token, which
    # both agents took; a namespace the pool does not admit got no token
    assert evidence.tenant == evidence.tenant_id_of_salt  # the id is kvpool tenant-id's
    assert evidence.secret_keys == [
        "endpoint", "namespace", "pool", "salt", "space-docs", "tenant-id", "token"
    ]  # fmt: skip
    assert (evidence.refused["reason"], evidence.refused["secret"]) == (
        "NamespaceNotAllowed",
        False,
    )
    assert evidence.tenant_ready["status"] == "True"
    assert evidence.salt_outside_secrets == []

    # the operator made the pool's children, and the pool turned Ready with both nodes
    assert evidence.pool_ready["status"] == "True"
    assert evidence.pool_ready["readyNodes"] == 2
    spec = yaml.safe_load((MANIFESTS / "pool.yaml").read_text())["spec"]
    assert evidence.chunk_tokens == spec["chunkTokens"], evidence.discovery

    _assert_wired_by_the_label(evidence)

    # the second engine loaded the first one's KV through node-a's agent: same answer
    assert evidence.first is not None and evidence.second is not None
    assert evidence.first.counters["stored_chunks"] >= evidence.prompt_chunks
    assert evidence.second.cached == [evidence.prompt_chunks * evidence.chunk_tokens]
    assert evidence.second.counters["loaded_chunks"] >= evidence.prompt_chunks
    assert not evidence.second.differences(evidence.first)  # up to noise (connector/greedy.py)
    assert evidence.status_a["chunks"] >= evidence.prompt_chunks
    assert evidence.status_a["hits"] >= evidence.prompt_chunks
    assert evidence.status_b["chunks"] == 0, "node-b's agent holds nothing: agents are local"
    _assert_pulled_through_the_peer(evidence)

    # the index follows both agents (found through the API server) and routes the prompt
    # to node-a, which holds its prefix; another salt matches nothing (least loaded wins)
    assert [node["node"] for node in evidence.index_nodes] == ["node-a", "node-b"]
    route = evidence.route
    assert (route["node"], route["reason"]) == ("node-a", "longest_match"), route
    assert route["matched_tokens"] == evidence.prompt_chunks * evidence.chunk_tokens
    other = evidence.route_other_salt
    assert (other["node"], other["reason"], other["matches"]) == ("node-b", "low_match", [])
    # a team's minted token is no credential for the index, which knows the admins' and
    # gateways' tokens only: tenants cannot route
    assert evidence.tenant_on_index_status == 401
    assert evidence.gateway_on_agent_status == 403  # gateways cannot touch an agent

    _assert_shared_through_the_space(evidence)
    _assert_chunk_files_through_the_door(evidence)

    # the chunks are team-a's; its pod set its quota with the token from its Secret, within
    # its ceiling (above it: 403), and the quota applies on both agents
    assert evidence.usage_before["chunks"] >= evidence.prompt_chunks
    limit = evidence.quota_set["limit_bytes"]
    assert (evidence.quota_set["tenant"], evidence.quota_set["explicit"]) == (evidence.tenant, True)
    assert evidence.usage_after["used_bytes"] <= limit < evidence.usage_before["used_bytes"]
    assert evidence.usage_after["evicted_chunks"] > 0
    assert evidence.above_ceiling_status == 403
    assert (evidence.quota_on_b["limit_bytes"], evidence.quota_on_b["explicit"]) == (limit, True)
    assert any(evidence.tenant in key + value for key, value in evidence.quota_configmap.items())
    assert evidence.other_tenant_status == 403
    assert evidence.other_team_status == 403  # team-b's token, on team-a's tenant

    # deleting team-a's KVCacheTenant revoked its token on both agents and dropped its chunks
    assert evidence.revoked_statuses == [401, 401]
    assert evidence.usage_after_tenant_delete["used_bytes"] == 0

    # deleting the pool deleted its children; the agents stopped cleanly
    assert not any(evidence.children_after_delete.values())
    assert evidence.agent_exit_codes == [0, 0]
    assert evidence.index_exit_code == 0
    assert evidence.pool_gone["reason"] == "PoolNotFound"  # team-b's tenant stays, refused


def _assert_pulled_through_the_peer(evidence: Evidence) -> None:
    """Until an engine on node-b asks: then its agent pulls the prompt from node-a's."""
    assert evidence.on_node_b is not None and evidence.first is not None
    assert evidence.on_node_b.cached == [evidence.prompt_chunks * evidence.chunk_tokens]
    assert not evidence.on_node_b.differences(evidence.first)
    (peer,) = evidence.peers_b["peers"]
    assert peer["node"] == "node-a" and peer["reachable"] is True
    assert peer["fetched_chunks"] >= evidence.prompt_chunks
    assert evidence.peers_a["serving"]["served_chunks"] >= evidence.prompt_chunks


def _assert_wired_by_the_label(evidence: Evidence) -> None:
    """The vLLM pods carry only the label: the webhook wired the connector's environment from
    team-a's Secret and (a tenant's pod: the node's segment holds every tenant's KV) the
    agent's door only, a read-only CSI volume mounted read-only, and not the agents' group:
    its connector maps the chunk files the door gives its token; the stored pod passes Pod
    Security "restricted", which team-a's namespace enforces (a hostPath pod is refused);
    each node's kubelet registered the chart's CSI plugin."""
    wired = evidence.wired
    attributes = {"pool": "main", "namespace": "inference"}
    assert wired["volumes"] == [
        {
            "name": "kvpool-segment",
            "csi": {"driver": "csi.kvpool.io", "volumeAttributes": attributes, "readOnly": True},
        }
    ]
    assert wired["mounts"] == [
        {"name": "kvpool-segment", "mountPath": "/var/run/kvpool", "readOnly": True}
    ]
    assert wired["env"]["KVPOOL_CONNECTOR_ENDPOINT"] == "tcp://kvpool-main.inference.svc:7400"
    assert wired["env"]["KVPOOL_CONNECTOR_DOOR_PATH"] == DOOR
    assert "KVPOOL_CONNECTOR_TRANSPORT" not in wired["env"]  # auto: chunk files from the door
    assert "KVPOOL_CONNECTOR_SEGMENT_PATH" not in wired["env"]
    assert wired["env"]["KVPOOL_CONNECTOR_TOKEN"]["secretKeyRef"]["name"] == "kvpool-cache-kvpool"
    assert wired["supplementalGroups"] is None
    assert evidence.wired_violations == []
    assert 'violates PodSecurity "restricted:latest"' in evidence.hostpath_refused
    assert "hostPath" in evidence.hostpath_refused
    assert {info["name"] for info in evidence.csi_registered.values()} == {"csi.kvpool.io"}


def _assert_shared_through_the_space(evidence: Evidence) -> None:
    """Team-b's engine hit on the system prompt team-a's engine stored in the space 'docs',
    and on none of team-a's own chunks; the shared chunks are in the space's account."""
    assert evidence.shared_first is not None and evidence.shared_reference is not None
    assert evidence.shared_other is not None and evidence.shared_same_tokens is not None
    shared = 2 * evidence.chunk_tokens  # the boundary (532 tokens) rounds down to two chunks
    assert evidence.shared_first.cached == [0]
    assert evidence.shared_reference.cached == [0]
    assert evidence.shared_other.cached == [shared]
    assert not evidence.shared_other.differences(evidence.shared_reference)
    assert evidence.shared_same_tokens.cached == [shared]  # team-a's third chunk stays hers
    assert not evidence.shared_same_tokens.differences(evidence.shared_first)
    assert evidence.space_usage["chunks"] == 2
    (space,) = evidence.space_status
    assert (space["name"], space["tenantId"]) == ("docs", evidence.space_tenant)
    assert space["usage"]["l1Bytes"] >= evidence.space_usage["used_bytes"]


def _assert_chunk_files_through_the_door(evidence: Evidence) -> None:
    """Every engine (a tenant's pod) mapped its chunk files from the agent's door, zero-copy
    (none fell back to the agent's messages), and so did the doctor's canary; the door gives
    a team's pod its own file read-write, its space's read-only and another team's not at
    all, and the pod's volume holds nothing but the door."""
    expected = [f"kvpool worker 0: maps chunk files from the agent's door {DOOR}"]
    assert evidence.connector_transport == dict.fromkeys(
        ("vllm-1", "vllm-2", "vllm-3", "vllm-4"), expected
    )
    checks = {line.split()[1]: line for line in evidence.doctor.splitlines() if line[:4] == "PASS"}
    assert "the agent's door" in checks["door"] and DOOR in checks["door"]
    assert f"chunk files from the agent's door {DOOR}" in checks["transport"]
    assert f"through a chunk file from {DOOR}" in checks["canary"]
    assert evidence.door["volume"] == ["agent.sock"]
    files, owners = evidence.door["files"], evidence.door["owners"]
    assert files["own"] == {"owner": owners["own"], "writable": True}, files
    assert files[SPACE] == {"owner": evidence.space_tenant, "writable": False}, files
    assert owners[TEAMS[0]] == evidence.tenant and set(files[TEAMS[0]]) == {"refused"}, files
