"""The hit-rate check: no tenant looks chunks up again and again without ever hitting.

Reads every tenant's counters from the agent's HTTP API (``GET /v1/tenants``, admin
token): tenants holding chunks or a quota, and the most recently active of the others
(a starved tenant that keeps looking up stays among them). The counters run since the
agent made the record (not a recent window), and count chunks, not requests. A tenant
with at least ``min_lookups`` chunk lookups and not one hit is the silent zero-hit
deployment: its engines never find what they stored. The canary tenant is left out.
"""

from __future__ import annotations

from kvpool.common.api_models import TenantUsages, Usage
from kvpool.common.keys import CANARY_TENANT
from kvpool.tools.doctor.agent_http import admin_get
from kvpool.tools.doctor.report import Check, failed, passed

NAME = "hit-rate"
SHOWN = 5
"""Tenants named in a passing line, the busiest first."""
SINCE = "counted since the agent started"


def check_hit_rate(
    http_url: str | None, token: str | None, min_lookups: int, timeout: float
) -> Check:
    usages = admin_get(
        NAME, "/v1/tenants", TenantUsages, http_url=http_url, token=token, timeout=timeout
    )
    if isinstance(usages, Check):
        return usages
    tenants = sorted(
        (usage for usage in usages.tenants if usage.tenant != CANARY_TENANT),
        key=lambda usage: usage.hits + usage.misses,
        reverse=True,
    )
    starved = [usage for usage in tenants if usage.hits == 0 and usage.misses >= min_lookups]
    if starved:
        return failed(
            NAME,
            f"{SINCE}: "
            + "; ".join(f"tenant {_described(usage)}, never a hit" for usage in starved),
            "its engines never find what they stored: do its requests carry one cache_salt, "
            "and do its engines serve one model with one dtype, KV layout and chunk size? "
            "stored_chunks 0: its stores fail or its quota is 0; all of them evicted: L1 or "
            "its quota is too small for its working set",
        )
    if not any(usage.hits + usage.misses for usage in tenants):
        return passed(NAME, f"{SINCE}: no tenant has looked anything up")
    busiest = "; ".join(f"tenant {_described(usage)}" for usage in tenants[:SHOWN])
    more = f"; {len(tenants) - SHOWN} more" if len(tenants) > SHOWN else ""
    return passed(
        NAME,
        f"{SINCE}: {busiest}{more}; no tenant with {min_lookups}+ chunk lookups and no hit",
    )


def _described(usage: Usage) -> str:
    lookups = usage.hits + usage.misses
    rate = f" ({usage.hits / lookups:.0%})" if lookups else ""
    return (
        f"{usage.tenant}: {usage.hits} of {lookups} chunk lookups hit{rate}, "
        f"{usage.stored_chunks} stored, {usage.evicted_chunks} evicted"
    )
