"""The names the parts of kvpool agree on: labels, annotations, environment variables, the
names of a pool's objects and segment, and the defaults the KVCachePool CRD shares.

The operator writes these names and the agent, the connector (inside vLLM), the index and
``kvpool doctor`` read them, so each is spelled here once. The Helm chart cannot import
Python; it spells its own objects' names. Standard library only: the connector imports
this module inside vLLM.
"""

from __future__ import annotations

from pathlib import Path

APP = "kvpool"
"""The value of the name label of every object of a pool."""

# The custom resources' API, as the operator serves it and the CSI plugin reads it.
API_GROUP = "kvpool.io"
API_VERSION = "v1alpha1"
POOL_PLURAL = "kvcachepools"

# Labels of a pool's objects and pods.
NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
POOL_LABEL = "kvpool.io/pool"
CACHE_POOL_LABEL = "kvpool.io/cache-pool"
"""On a tenant's pod: the pool whose cache it uses. The operator's admission webhook wires
every pod so labelled (the pool's volume, the connector's environment); see
:data:`SEGMENT_MOUNT_DIR`."""
ROLE_LABEL = "kvpool.io/role"
"""On a model server pod: what the endpoint picker may give it under prefill/decode
disaggregation (``prefill``, ``decode`` or ``both``); the admission webhook gives a pod of a
pool that disaggregates, labelled ``decode`` or ``both``, the decode sidecar."""
OPERATOR = "kvpool-operator"
"""The managed-by label of the operator's objects, and its field manager."""
AGENT_COMPONENT = "agent"
INDEX_COMPONENT = "index"
"""Values of the component label: the agents' objects and pods, the index's."""

# Annotations.
CONFIG_CHECKSUM_ANNOTATION = "kvpool.io/config-checksum"
"""On a pod template: rolls the pods when their configuration file changes."""
ZMQ_PORT_ANNOTATION = "kvpool.io/zmq-port"
HTTP_PORT_ANNOTATION = "kvpool.io/http-port"
SEGMENT_PATH_ANNOTATION = "kvpool.io/segment-path"
CHUNK_TOKENS_ANNOTATION = "kvpool.io/chunk-tokens"
PROTOCOL_VERSION_ANNOTATION = "kvpool.io/protocol-version"
"""The pool Service's annotations above tell a connector how to reach and use its agent."""

# Environment variables.
AGENT_ENV_PREFIX = "KVPOOL_"
"""Of every field of the agent's configuration (``KVPOOL_HOST``, ``KVPOOL_ZMQ_PORT``...)."""
AGENT_CONFIG_FILE_ENV = "KVPOOL_CONFIG_FILE"
"""The agent's configuration file."""
AGENT_HOST_ENV = f"{AGENT_ENV_PREFIX}HOST"
INDEX_ENV_PREFIX = "KVPOOL_INDEX_"
INDEX_CONFIG_FILE_ENV = "KVPOOL_INDEX_CONFIG_FILE"
"""The index's configuration file."""
CONNECTOR_ENV_PREFIX = "KVPOOL_CONNECTOR_"
"""Of the connector's variables (inside vLLM, and ``kvpool doctor`` as a connector): its
overrides of ``kv_connector_extra_config`` and its token."""
CONNECTOR_ENDPOINT_ENV = f"{CONNECTOR_ENV_PREFIX}ENDPOINT"
CONNECTOR_SEGMENT_PATH_ENV = f"{CONNECTOR_ENV_PREFIX}SEGMENT_PATH"
"""Where this pod sees the agent's segment (the agent's own is ``KVPOOL_SEGMENT_PATH``)."""
CONNECTOR_CHUNK_TOKENS_ENV = f"{CONNECTOR_ENV_PREFIX}CHUNK_TOKENS"
CONNECTOR_TRANSPORT_ENV = f"{CONNECTOR_ENV_PREFIX}TRANSPORT"
"""``messages``: the connector maps no chunk file; KV moves through the agent's messages."""
CONNECTOR_DOOR_PATH_ENV = f"{CONNECTOR_ENV_PREFIX}DOOR_PATH"
"""The agent's door (a Unix socket) where a connector gets the chunk files its token may
map; the webhook sets it in every wired pod."""
CONNECTOR_TOKEN_ENV = f"{CONNECTOR_ENV_PREFIX}TOKEN"
"""The connector's token for its agent's ZMQ port (a pod sets it from its team's Secret)."""
CONNECTOR_TOKEN_FILE_ENV = f"{CONNECTOR_ENV_PREFIX}TOKEN_FILE"
"""Or the file that holds it."""
CONNECTOR_OLD_NAMES = {
    CONNECTOR_ENDPOINT_ENV: "KVPOOL_ENDPOINT",
    CONNECTOR_SEGMENT_PATH_ENV: "KVPOOL_SEGMENT_PATH",
    CONNECTOR_CHUNK_TOKENS_ENV: "KVPOOL_CHUNK_TOKENS",
    CONNECTOR_TRANSPORT_ENV: "KVPOOL_TRANSPORT",
    CONNECTOR_DOOR_PATH_ENV: "KVPOOL_DOOR_PATH",
    CONNECTOR_TOKEN_ENV: "KVPOOL_TOKEN",
    CONNECTOR_TOKEN_FILE_ENV: "KVPOOL_TOKEN_FILE",
}
"""Each connector variable's old name, from before the connector's variables had a prefix
of their own (``KVPOOL_SEGMENT_PATH`` named the agent's segment too): the connector still
reads it, with one warning per process, and the webhook writes it beside the new one for
the connectors that know only the old names."""
CACHE_SALT_ENV = "KVPOOL_CACHE_SALT"
"""The team's cache salt (a pod sets it from its team's Secret), for its requests'
``cache_salt``: the application's, not the connector's."""
ADMIN_TOKEN_ENV = "KVPOOL_ADMIN_TOKEN"
"""An admin token of the pool, for ``kvpool doctor``."""
OPERATOR_AGENT_IMAGE_ENV = "KVPOOL_AGENT_IMAGE"
"""The operator's default agent image (the chart sets it)."""
SHARED_VARIABLES = (
    *CONNECTOR_OLD_NAMES,
    *CONNECTOR_OLD_NAMES.values(),
    CACHE_SALT_ENV,
    ADMIN_TOKEN_ENV,
    OPERATOR_AGENT_IMAGE_ENV,
)
"""The ``KVPOOL_`` variables of the connector (by their new and old names), the tools and
the operator, which no settings model holds (but the agent's ``KVPOOL_SEGMENT_PATH``): the
agent and the index take them as known (one shell or pod may set them for another part),
and refuse any other ``KVPOOL_`` variable that is not a setting of theirs."""

# The agent's door: a directory beside its segment (``<segment>.door``) holding one Unix
# socket, the only part of the pool's directory a tenant's pod is given.
DOOR_SUFFIX = ".door"
DOOR_SOCKET = "agent.sock"

# Configuration files, as the keys of their ConfigMaps.
AGENT_CONFIG_KEY = "agent.yaml"
INDEX_CONFIG_KEY = "index.yaml"

# Ports the agents and the index listen on unless the pool names others.
DEFAULT_ZMQ_PORT = 7400
DEFAULT_HTTP_PORT = 7401
DEFAULT_EVENTS_PORT = 7402
DEFAULT_INDEX_PORT = 7403
DEFAULT_PEER_PORT = 7404
DEFAULT_PICKER_PORT = 7405
"""The endpoint picker's gRPC port (Envoy's external processing; the GAIE's charts use 9002)."""
"""Where an agent serves its L1 and NVMe chunks to the pool's other agents."""
NODE_NAME_ENV = "NODE_NAME"
"""The node a pod runs on (the downward API's ``spec.nodeName``): the agent's name among its
peers, and the CSI plugin's node id."""

# Eviction policies: the names a configuration (and the CRD) may give, each a class in
# kvpool.agent.core.policies.POLICIES (a test keeps the two the same). Adding a policy is
# a name here, a module in agent/core/policies/ and a line in its registry.
POLICY_NAMES: tuple[str, ...] = ("lru", "arc")

# The index's defaults, which the CRD's defaults come from (kvpool.operator.spec.index).
DEFAULT_LOAD_FACTOR = 1.5
DEFAULT_MIN_MATCH_RATIO = 0.3
DEFAULT_LOAD_SLACK = 0.0
DEFAULT_MAX_CHUNKS_PER_NODE = 1_000_000

# Prefill/decode disaggregation's defaults: the picker's (picker.pd) and the decode
# sidecar's (kvpool-pd-sidecar), which the CRD's defaults come from
# (kvpool.operator.spec.disaggregation).
DEFAULT_PD_THRESHOLD_TOKENS = 512
DEFAULT_PD_MAX_PREFILL_WAITING = 4
DEFAULT_PD_HEADER_TTL_SECONDS = 30
DEFAULT_PD_PREFILL_TIMEOUT_SECONDS = 30
DEFAULT_PD_DECODE_WAIT_MS = 2000
MAX_PD_DECODE_WAIT_MS = 600_000
"""The longest wait a decode's params, the sidecar or the CRD may ask for."""
DEFAULT_PD_VLLM_PORT = 8200
"""The decode pod's vLLM, behind its sidecar (which takes the port the InferencePool
targets)."""


def service_name(pool: str) -> str:
    """The pool's Service, whose annotations a connector discovers its agent by."""
    return f"kvpool-{pool}"


def agent_name(pool: str) -> str:
    """The agents' DaemonSet, ServiceAccount, Role, RoleBinding and NetworkPolicy."""
    return f"kvpool-{pool}-agent"


def config_map_name(pool: str) -> str:
    """The ConfigMap of the agents' configuration (key :data:`AGENT_CONFIG_KEY`)."""
    return f"kvpool-{pool}-config"


def quotas_name(pool: str) -> str:
    """The ConfigMap of the pool's tenant quotas, which the agents write."""
    return f"kvpool-{pool}-quotas"


def tenants_name(pool: str) -> str:
    """The ConfigMap of the pool's KVCacheTenants (token digests, quota ceilings), which the
    operator writes and the agents watch."""
    return f"kvpool-{pool}-tenants"


def index_access_name(pool: str) -> str:
    """The Secret of the token the pool's index follows its agents with (key ``token``),
    minted by the operator; the agents learn its digest from the tenants ConfigMap."""
    return f"kvpool-{pool}-index-access"


def index_name(pool: str) -> str:
    """The index's Deployment, Service, ServiceAccount, Role, RoleBinding and
    NetworkPolicy."""
    return f"kvpool-{pool}-index"


def index_config_map_name(pool: str) -> str:
    """The ConfigMap of the index's configuration (key :data:`INDEX_CONFIG_KEY`)."""
    return f"kvpool-{pool}-index-config"


DEFAULT_STATE_DIR = Path.home() / ".local" / "state" / "kvpool"
"""Where the embedded default keeps its state (the agent's and the index's ``state_dir``)."""
DEFAULT_POOL = "default"
"""The embedded default's pool name."""


def generated_token_path(state_dir: Path, role: str, pool: str) -> Path:
    """Where an agent without a tokens file writes the token it generates for ``role``
    (``admin``, ``engine``, ``index``): ``<state_dir>/<role>-token-<pool>``, mode 0600."""
    return state_dir / f"{role}-token-{pool}"


SHM_DIR = Path("/dev/shm")
"""The node's shared-memory filesystem, where each pool's agent keeps its segment."""
SEGMENT_FILE = "segment"
"""The segment's name in its pool's directory (beside its lock and probe table)."""
DOOR_DIRECTORY = SEGMENT_FILE + DOOR_SUFFIX
"""The door's directory in its pool's directory."""


def segment_dir(pool: str) -> Path:
    """The pool's directory on a node: its segment, lock and probe table, and its door
    (:data:`DOOR_DIRECTORY`), and nothing else, so that it can be published into an
    engine's pod whole (the CSI plugin bind-mounts it; a tenant's pod gets the door only)."""
    return SHM_DIR / f"kvpool-{pool}"


def segment_path(pool: str) -> Path:
    """The pool's L1 segment on a node, unless the agent's configuration names another."""
    return segment_dir(pool) / SEGMENT_FILE


CSI_DRIVER = "csi.kvpool.io"
"""The CSI driver that publishes a pool's directory, or only its door, into a pod (an inline
ephemeral volume with the attributes :data:`CSI_POOL_ATTRIBUTE` and
:data:`CSI_NAMESPACE_ATTRIBUTE`)."""
CSI_POOL_ATTRIBUTE = "pool"
CSI_NAMESPACE_ATTRIBUTE = "namespace"
"""The volume attributes that name the pool and the pool's namespace."""
SEGMENT_MOUNT_DIR = Path("/var/run/kvpool")
"""Where the webhook mounts the pool's volume in a labelled pod: in an engine's pod the
pool's directory (the connector maps ``SEGMENT_MOUNT_DIR / SEGMENT_FILE``; the door is
``SEGMENT_MOUNT_DIR / DOOR_DIRECTORY / DOOR_SOCKET``), in a tenant's pod its door directory
(the door is ``SEGMENT_MOUNT_DIR / DOOR_SOCKET``)."""


def agent_pods_selector(pool: str) -> str:
    """The label selector of the pool's agent pods."""
    return f"{COMPONENT_LABEL}={AGENT_COMPONENT},{POOL_LABEL}={pool}"
