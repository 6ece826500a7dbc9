"""One process's line to the agent, built so that the agent can never stop vLLM.

:class:`AgentLink` offers the connector's calls to the agent as typed methods;
each goes to an :class:`~kvpool.client.AgentClient` through one guard that
adds what serving needs around it:

* a failure (timeout, refused connection, unreadable Service) marks the agent
  *down*: one warning, a counter, and no further calls until a pause has passed
  (``retry_min_s``, doubling up to ``retry_max_s`` while it stays down), so a
  dead agent costs one timeout per pause rather than one per request;
* the next call after the pause tries again; the client reconnects and says
  hello by itself, and a restarted agent (new ``agent_id``) is reported to
  ``on_new_agent`` so the worker can map the chunk files of a re-created segment;
* refusals (:class:`~kvpool.client.AgentError`) are not outages: the agent
  answered, so the caller decides; except a refused token (``unauthenticated``,
  ``forbidden`` at hello) and a missing one, which are: one warning that says where the
  token comes from, and the same pauses (a fixed Secret is read at the next try).

Callers catch :class:`LinkDown` and carry on without the cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import zmq

from kvpool.client import (
    AgentClient,
    AgentError,
    AgentInfo,
    AgentUnavailable,
    Payload,
    PrefetchProgress,
)
from kvpool.client.mapped_files import ChunkFileError, MappedChunkFiles
from kvpool.common.protocol import ErrorCode, ProtocolError
from kvpool.common.transfer_results import LookupResult, StorePlan, StoreResult
from kvpool.connector.counters import Counters
from kvpool.connector.discovery import AgentAddress, DiscoveryError
from kvpool.connector.identity import Credential, CredentialMissing

log = logging.getLogger(__name__)

T = TypeVar("T")
Resolver = Callable[[], AgentAddress]
ClientFactory = Callable[[str, str, float], AgentClient]
"""(endpoint, token, timeout) -> a client."""


_OUTAGES = (AgentUnavailable, DiscoveryError, ChunkFileError, OSError, zmq.ZMQError, ProtocolError)
"""What marks the agent down: no answer, no address, no segment, or an answer that is not one
(a missing token too: :class:`CredentialMissing` is an OSError)."""
_REFUSED_TOKEN = frozenset((ErrorCode.UNAUTHENTICATED, ErrorCode.FORBIDDEN))


class LinkDown(ConnectionError):
    """The agent is unavailable now; the caller goes on without the cache."""


def _default_client(endpoint: str, token: str, timeout: float) -> AgentClient:
    return AgentClient(endpoint, token=token, client_name="kvpool-vllm-connector", timeout=timeout)


class AgentLink:
    def __init__(
        self,
        resolve: Resolver,
        *,
        credential: Credential,
        role: str,
        timeout: float,
        retry_min_s: float,
        retry_max_s: float,
        counters: Counters,
        client_factory: ClientFactory = _default_client,
        clock: Callable[[], float] = time.monotonic,
        on_new_agent: Callable[[AgentInfo], None] | None = None,
    ) -> None:
        self._resolve = resolve
        self._credential = credential
        self._role = role
        self._timeout = timeout
        self._retry_min = retry_min_s
        self._retry_max = retry_max_s
        self._counters = counters
        self._client_factory = client_factory
        self._clock = clock
        self._on_new_agent = on_new_agent
        self.address: AgentAddress | None = None
        self._client: AgentClient | None = None
        self._agent_id: str | None = None
        self.bound_tenant = ""
        """The tenant the token acts for (a KVCacheTenant's token), from the last hello."""
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._pause = retry_min_s

    @property
    def is_down(self) -> bool:
        return self._down_since is not None

    def usable(self) -> bool:
        """False while pausing after a failure (the call would be skipped)."""
        return self._down_since is None or self._clock() >= self._retry_at

    def lookup(
        self, tenant: str, keys: Sequence[bytes], *, lock: bool, count: bool
    ) -> LookupResult:
        return self._call(lambda client: client.lookup(tenant, keys, lock=lock, count=count))

    def lookup_prefetch(
        self, tenant: str, keys: Sequence[bytes], parent: bytes | None, *, count: bool
    ) -> tuple[LookupResult, int]:
        """An unlocked lookup (the scheduler's probe) that also asks the agent to load the rest
        from L2: (hit, prefetch id, 0 when none started)."""
        return self._call(
            lambda client: client.lookup_prefetch(tenant, keys, parent, lock=False, count=count)
        )

    def count_lookup(self, tenant: str, keys: Sequence[bytes]) -> None:
        """Send a counted, unlocked lookup without waiting for its answer."""
        self._call(lambda client: client.count_lookup(tenant, keys))

    def push(
        self, tenant: str, keys: Sequence[bytes], node: str, parent: bytes | None
    ) -> str | None:
        """Have the agent offer ``keys`` to the agent of ``node`` (why not, or None)."""
        return self._call(lambda client: client.push(tenant, keys, node, parent))

    def prefetch_status(self, prefetch: int, *, wait_ms: int) -> PrefetchProgress:
        return self._call(lambda client: client.prefetch_status(prefetch, wait_ms=wait_ms))

    def prepare_store(
        self, tenant: str, keys: Sequence[bytes], sizes: Sequence[int], parent: bytes | None
    ) -> StorePlan:
        return self._call(lambda client: client.prepare_store(tenant, keys, sizes, parent))

    def commit_store(self, lease: int) -> int:
        return self._call(lambda client: client.commit_store(lease))

    def release(self, lease: int) -> None:
        self._call(lambda client: client.release(lease))

    def retrieve_inline(self, tenant: str, keys: Sequence[bytes]) -> list[bytes]:
        return self._call(lambda client: client.retrieve_inline(tenant, keys))

    def store_inline(
        self,
        tenant: str,
        keys: Sequence[bytes],
        chunks: Sequence[Payload],
        parent: bytes | None,
    ) -> StoreResult:
        return self._call(lambda client: client.store_inline(tenant, keys, chunks, parent))

    def release_later(self, lease: int) -> Callable[[], None]:
        """Send a release now; the returned call waits for its answer (and raises as
        :meth:`release` does)."""
        answer = self._call(lambda client: client.release_later(lease))
        return lambda: self._call(lambda client: answer())

    def _call(self, operation: Callable[[AgentClient], T]) -> T:
        """Run ``operation`` on the connected client, or raise :class:`LinkDown`."""
        if not self.usable():
            self._counters.add("agent_skipped_calls")
            raise LinkDown("the kvpool agent is down; pausing before the next try")
        connected = False
        try:
            client = self._connected()
            connected = True
            result = operation(client)
        except AgentError as error:
            # a token refused at hello, or revoked since, takes the link down; a request
            # refused for its tenant (a shared space this token is not admitted to) is that
            # request's refusal only
            if error.code not in _REFUSED_TOKEN or (
                connected and error.code == ErrorCode.FORBIDDEN
            ):
                raise
            self._client = None
            self._failed(CredentialMissing(f"the agent refused the connector's token ({error})"))
            raise LinkDown(str(error)) from error
        except _OUTAGES as error:
            if not isinstance(error, AgentUnavailable):  # that one reset the client already
                self._client = None  # start again from a fresh socket and session
            self._failed(error)
            raise LinkDown(str(error)) from error
        self._check_agent(client)
        if self._down_since is not None:
            log.warning(
                "kvpool %s: agent at %s is back after %.1f s; using the cache again",
                self._role,
                client.endpoint,
                self._clock() - self._down_since,
            )
            self._down_since = None
            self._pause = self._retry_min
        return result

    def chunk_files(self, door: Path) -> MappedChunkFiles:
        """Chunk files to map from the agent's door at ``door``, asked for with this link's
        token."""
        return MappedChunkFiles(door, self._credential(), self._timeout)

    def info(self) -> AgentInfo:
        """The agent's hello reply (connecting first if needed)."""
        return self._call(self._require_info)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _connected(self) -> AgentClient:
        if self._client is None:
            if self.address is None:
                self.address = self._resolve()
            self._client = self._client_factory(
                self.address.endpoint, self._credential(), self._timeout
            )
        if self._client.info is None:
            self._client.connect()
        return self._client

    @staticmethod
    def _require_info(client: AgentClient) -> AgentInfo:
        if client.info is None:  # a call dropped the session and did not reconnect
            client.connect()
        assert client.info is not None
        return client.info

    def _check_agent(self, client: AgentClient) -> None:
        info = client.info
        if info is None:
            return
        self.bound_tenant = info.tenant
        if info.agent_id == self._agent_id:
            return
        first = self._agent_id is None
        self._agent_id = info.agent_id
        if not first:
            self._counters.add("agent_restarts_seen")
            log.warning("kvpool %s: the agent restarted (now %s)", self._role, info.agent_id)
        if self._on_new_agent is not None:
            self._on_new_agent(info)

    def _failed(self, error: Exception) -> None:
        now = self._clock()
        self._counters.add("agent_failures")
        if self._down_since is None:
            self._down_since = now
            self._pause = self._retry_min
            log.warning(
                "kvpool %s: agent unavailable (%s); vLLM goes on without the cache "
                "(recomputing) and retries in %.1f s",
                self._role,
                error,
                self._pause,
            )
        else:
            self._pause = min(self._pause * 2, self._retry_max)
        self._retry_at = now + self._pause
