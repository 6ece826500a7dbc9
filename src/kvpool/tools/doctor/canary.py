"""The canary check: a chunk goes through the agent both ways, as the connector moves KV.

1. Clear the canary tenant (what a run that died half-way left behind).
2. Agent to pod: the agent stores a chunk itself (``store_inline``); this pod looks it
   up (read-locked), copies it out of *its* mapping of the canary's chunk file (from the
   agent's door) and releases it. Other bytes mean this pod maps another file than the
   agent writes.
3. Pod to agent, the connector's store and load: ``prepare_store``, copy into the mapped
   chunk file, ``commit_store``; a locked ``lookup``, copy out, ``release``; and the agent's
   own view of the same chunk (``retrieve_inline``). Every copy must be the bytes stored.
4. Clear the canary tenant, and look again: nothing is left in L1.

A pod that cannot reach the door moves KV through the agent's messages (the connector's
inline transport): its canary stores a chunk with ``store_inline`` and reads it back with
``retrieve_inline`` instead of steps 2 and 3.

The chunks are random bytes under a reserved tenant id,
:data:`kvpool.common.keys.CANARY_TENANT`. The agent takes only well-formed ids (32 hex
characters), so the id is one: a SHA-256 digest in a domain of its own
(``kvpool-doctor-canary-v1``), where a tenant's id is a digest in the ``kvpool-tenant-v1``
domain. A salt whose id were the canary's would be a 128-bit preimage of SHA-256. The
agent's write-back skips the canary, so nothing reaches L2. Every chunk token may use the
canary tenant, so the agent keeps it from being anyone's store: chunks of
:data:`~kvpool.common.keys.CANARY_CHUNK_BYTES` only, a fixed quota, and keys scoped to the
session (the doctor's one session finds its own chunks; another finds none of them).
Lookups do not count (``count=False``); the agent's inline read counts one hit for the
canary tenant, which the hit-rate check leaves out.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

from kvpool.client import AgentClient, AgentError, AgentUnavailable, copy_in, copy_out
from kvpool.client.mapped_files import ChunkFileError
from kvpool.common.keys import CANARY_CHUNK_BYTES, CANARY_TENANT
from kvpool.tools.doctor.report import Check, failed, passed, size
from kvpool.tools.doctor.shared_memory import OTHER_FILE

NAME = "canary"
_AGENT_KEY = hashlib.sha256(b"kvpool-doctor-canary-v1\0agent-to-pod").digest()
_POD_KEY = hashlib.sha256(b"kvpool-doctor-canary-v1\0pod-to-agent").digest()

Failure = tuple[str, str]
"""What was seen, and the fix."""

_AGENT_FAILED = "the agent's log says why (kubectl logs, or the kvpool-agent process's stderr)"


def check_canary(client: AgentClient) -> Check:
    """The canary through this pod's mapping of its chunk file (from the client's door)."""
    try:
        return _canary(
            client,
            lambda: _agent_to_pod(client) or _pod_to_agent(client),
            "stored by the agent and read here, stored here and read by the agent, loaded "
            f"back through a chunk file from {client.door_path}",
        )
    finally:
        client.close_files()


def check_canary_inline(client: AgentClient) -> Check:
    """The canary through the agent's messages (no chunk file mapped here)."""
    return _canary(
        client,
        lambda: _through_messages(client),
        "stored through the agent's messages and read back the same way",
    )


def _canary(client: AgentClient, run: Callable[[], Failure | None], how: str) -> Check:
    failure: Failure | None
    try:
        client.clear(CANARY_TENANT)
        failure = run()
    except (AgentError, AgentUnavailable) as error:
        failure = (f"the agent failed the canary: {error}", _AGENT_FAILED)
    except ChunkFileError as error:
        failure = (f"this pod cannot map the canary's chunk file: {error}", OTHER_FILE)
    left = _clear(client)
    if failure is not None:
        seen, fix = failure
        return failed(NAME, seen if left is None else f"{seen}; {left}", fix)
    if left is not None:
        return failed(NAME, left, _AGENT_FAILED)
    return passed(
        NAME,
        f"{size(CANARY_CHUNK_BYTES)} chunks under the reserved tenant {CANARY_TENANT}: {how}; "
        "identical bytes; cleared, nothing left",
    )


def _through_messages(client: AgentClient) -> Failure | None:
    payload = os.urandom(CANARY_CHUNK_BYTES)
    stored = client.store_inline(CANARY_TENANT, [_POD_KEY], [payload])
    if stored.stored != 1:
        return _refused(stored.refused)
    if client.retrieve_inline(CANARY_TENANT, [_POD_KEY]) != [payload]:
        return ("canary mismatch: the agent sent back other bytes than it was sent", _AGENT_FAILED)
    return None


def _agent_to_pod(client: AgentClient) -> Failure | None:
    payload = os.urandom(CANARY_CHUNK_BYTES)
    stored = client.store_inline(CANARY_TENANT, [_AGENT_KEY], [payload])
    if stored.stored != 1:
        return _refused(stored.refused)
    hit = client.lookup(CANARY_TENANT, [_AGENT_KEY], count=False)
    if hit.lease is None:
        return ("the agent stored the canary, then its lookup missed it", _AGENT_FAILED)
    try:
        (seen,) = copy_out(client.files(), hit)
    finally:
        client.release(hit.lease)
    if seen != payload:
        return (
            f"canary mismatch: the agent wrote the canary at offset {hit.offsets[0]} of its "
            f"chunk file {hit.file}; this pod's mapping of it holds other bytes there",
            OTHER_FILE,
        )
    return None


def _pod_to_agent(client: AgentClient) -> Failure | None:
    payload = os.urandom(CANARY_CHUNK_BYTES)
    plan = client.prepare_store(CANARY_TENANT, [_POD_KEY], [len(payload)])
    if plan.lease is None:
        return _refused(plan.refused)
    if plan.offsets[0] < 0:
        return ("the canary was cached already: is another kvpool doctor running?", _RERUN)
    copy_in(client.files(), plan, [payload])
    if client.commit_store(plan.lease) != 1:
        return ("the agent did not commit the canary this pod stored", _AGENT_FAILED)
    hit = client.lookup(CANARY_TENANT, [_POD_KEY], count=False)
    if hit.lease is None:
        return ("the agent committed the canary, then its lookup missed it", _AGENT_FAILED)
    try:
        (loaded,) = copy_out(client.files(), hit)
    finally:
        client.release(hit.lease)
    agent_view = client.retrieve_inline(CANARY_TENANT, [_POD_KEY])
    if loaded != payload or agent_view != [payload]:
        return (
            f"canary mismatch: this pod stored the canary at offset {plan.offsets[0]}; it "
            f"loaded {'the same' if loaded == payload else 'other'} bytes back, the agent "
            f"read {'the same' if agent_view == [payload] else 'other'} bytes",
            OTHER_FILE,
        )
    return None


_RERUN = "run it again once the other run has finished"


def _refused(reason: str | None) -> Failure:
    return (
        f"the agent refused a {size(CANARY_CHUNK_BYTES)} canary: {reason}",
        "a full L1 of locked chunks refuses stores (GET /v1/status: open_leases), and so "
        "does a canary tenant whose chunks are all locked; an agent older than the canary's "
        "fixed quota gives it the pool's default tenant quota (spec.tenants.defaultQuota; "
        "0 caches nothing)",
    )


def _clear(client: AgentClient) -> str | None:
    """Clear the canary tenant; what went wrong, if anything did."""
    try:
        client.clear(CANARY_TENANT)
        left = sum(
            client.lookup(CANARY_TENANT, [key], lock=False, count=False).count
            for key in (_AGENT_KEY, _POD_KEY)
        )
    except (AgentError, AgentUnavailable) as error:
        return f"the canary tenant {CANARY_TENANT} could not be cleared: {error}"
    if left:
        return f"the canary tenant {CANARY_TENANT} still holds {left} chunks after clear"
    return None
