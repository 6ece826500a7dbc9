"""The L1 cache: index, chunk life cycle, locks under leases, eviction and tenant quotas.

It keeps metadata only; clients copy the bytes in and out of the shared segment
at the offsets it hands out. Life cycle of a chunk (one slot)::

    reserve ──► WRITING ──commit──► READY ◄──lookup/release──► READY, read-locked by N
       ▲          │ release      │            │ evicted (unlocked only) / cleared
       │          │              │ lease      ▼
      FREE ◄──────┴──────────────┼───────── DOOMED (cleared while locked; freed on the last unlock)
       ▲                         ▼ expires
       └── release / fence ── QUARANTINED (pages held, no key)

A WRITING chunk is invisible to readers and never evicted; a read-locked one is
never evicted. Every lock belongs to a lease that expires, so a crashed client
pins nothing for long.

A write lease that expires is quarantined, not freed: its client may be stalled
rather than dead, and still copy into those pages. Were they reused, its late
write would land in another chunk, another tenant's perhaps, and nothing would
notice. Quarantined pages stay allocated (counted by the watermarks and the
tenant's usage, never evicted, never handed out) until the lease is released
(the ZMQ server does so when the writer's session ends) or ``fence_seconds``
pass; its commit fails with :class:`~kvpool.agent.core.cache_types.LeaseExpired`. Read
leases need no quarantine: a reader that copies from reused pages writes nothing into the
segment, and the connector treats a load whose release fails as a failure.

Chunks form chains (``k_i`` names its predecessor ``k_{i-1}``) and a chunk is
only reachable through its whole prefix. So only chain tails are victims: a
chunk the policy proposes goes after all of its descendants, which matters
because a long prompt stored over several steps has its head oldest (hits are
touched tail first, so a hit chain has its head newest). A run stored under a
predecessor that L1 lacks would be unreachable and is refused, unless L2 tiers
exist: then a prefetch can restore the prefix.

With L2 tiers there is one exception, for a store that could not proceed
otherwise: when tails alone cannot make room for the chunks it places (they do
not fit in L1, or in the tenant's quota: a chain longer than either, or one whose
other chunks are locked or being written back), older chunks go too, oldest
first, as many as the store needs and no more; so the rest of a chain longer
than L1 still reaches L1, and L2 through the write-back. Everything else takes
tails only, with L2 tiers or without: the watermarks (the part of a store's room
that is not needed to place it), the periodic maintenance, a shrunken quota and
:meth:`L1Cache.evict`. A chain that fits in L1 keeps its whole prefix, and a
prefetch that loads a prefix's missing tail never evicts its head.

Eviction has three triggers: the high watermark (evict to the low one), an
allocation that does not fit (evict until it does, so a store fails for lack
of memory only when nothing is evictable), and a tenant over its quota (evict
only that tenant's chunks; a tenant never makes room for itself at the expense
of another: the room a store makes under the watermarks is what its quota lets its
tenant grow by, not the whole run). Within a tenant the configured policy orders victims; across
tenants, the victim whose last use is oldest goes first.

Pins (:mod:`~kvpool.agent.core.l1.pin_sets`): a tenant's named lists of keys whose ready
chunks no eviction takes (but a quota that shrank below them), up to the tenant's pin
budget in bytes; the rest of a pin's chunks stay ordinary ones.

Tenant records: tenants choose their ids (a new ``cache_salt`` is a new tenant), so
a record lives only while it holds something, a chunk (open leases hold chunks) or
a quota of its own. A record that holds nothing keeps its counters while it is
among the ``idle_tenants`` most recently active such records; past that the
oldest is dropped, so a flood of new ids costs a bounded amount of memory. The
cache-wide counters stay exact; a dropped record's counters go with it.

Not thread-safe: the agent reaches it only through
:class:`~kvpool.agent.service.cache_service.CacheService`, which calls it under one lock from
every thread (the ZMQ thread, the event loop, the HTTP handlers); only a few
counters (``open_write_leases``, ``quarantined_leases``) and quota limits are read
without that lock.

The package's parts, each with one job (:class:`L1Cache` puts them together):

* :mod:`~kvpool.agent.core.l1.slots`: the slot table, per-chunk metadata in flat arrays,
  and the chain links;
* :mod:`~kvpool.agent.core.l1.tenants`: tenant records and the trimming of idle ones;
* :mod:`~kvpool.agent.core.l1.chunks`: placing and freeing chunks (index, pages, usage;
  journal, probe table and listener told);
* :mod:`~kvpool.agent.core.l1.leases`: leases, their expiry, and quarantine;
* :mod:`~kvpool.agent.core.l1.pin_sets`: the tenants' pins and which chunks they hold;
* :mod:`~kvpool.agent.core.l1.planner`: which chunks an eviction takes;
* :mod:`~kvpool.agent.core.l1.eviction`: when eviction happens, and carrying it out;
* :mod:`~kvpool.agent.core.l1.cycle`: the reserve/commit/lookup cycle, the hot path;
* :mod:`~kvpool.agent.core.l1.accounting`: the tenants' quotas and usage, as callers see them;
* :mod:`~kvpool.agent.core.l1.maintenance`: the periodic check, and evicting and clearing
  on request;
* :mod:`~kvpool.agent.core.l1.restore`: the warm restore from the segment's journal;
* :mod:`~kvpool.agent.core.l1.reports`: its statistics and listings of its keys;
* :mod:`~kvpool.agent.core.l1.cache`: :class:`L1Cache`, the facade that builds the parts
  and hands each call to one of them;
* :mod:`~kvpool.agent.core.l1.debug` and :mod:`~kvpool.agent.core.l1.invariants`: a copy of the
  bookkeeping and the check of its rules, for tests and debugging.
"""

from kvpool.agent.core.l1.cache import L1Cache
from kvpool.agent.core.l1.debug import L1DebugView, LeaseView, SlotView, TenantView
from kvpool.agent.core.l1.invariants import InvariantError
from kvpool.agent.core.l1.slots import NIL, State
from kvpool.agent.core.l1.tenants import IDLE_TENANTS

__all__ = [
    "IDLE_TENANTS",
    "NIL",
    "InvariantError",
    "L1Cache",
    "L1DebugView",
    "LeaseView",
    "SlotView",
    "State",
    "TenantView",
]
