"""The hit-rate check: no tenant looks chunks up again and again without ever hitting.

Reads every tenant's counters from the agent's HTTP API (``GET /v1/tenants``, admin
token): tenants holding chunks or a quota, and the most recently active of the others
(a starved tenant that keeps looking up stays among them). The counters run since the
agent made the record (not a recent window), and count chunks, not requests. A tenant
with at least ``min_lookups`` chunk lookups and not one hit is the silent zero-hit
deployment: its engines never find what they stored. The canary tenant is left out.
"""

from __future__ import annotations

import urllib.error
import urllib.request

from pydantic import ValidationError

from kvpool_agent.api_models import TenantUsages, Usage
from kvpool_agent.doctor.report import Check, failed, passed, skipped
from kvpool_agent.keys import CANARY_TENANT

NAME = "hit-rate"
SHOWN = 5
"""Tenants named in a passing line, the busiest first."""
SINCE = "counted since the agent started"


def check_hit_rate(
    http_url: str | None, token: str | None, min_lookups: int, timeout: float
) -> Check:
    if http_url is None:
        return skipped(NAME, "the agent's HTTP address is unknown (with --endpoint, give --http)")
    if token is None:
        return skipped(NAME, "no admin token (--admin-token-file, or KVPOOL_ADMIN_TOKEN)")
    url = f"{http_url}/v1/tenants"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            usages = TenantUsages.model_validate_json(response.read()).tenants
    except urllib.error.HTTPError as error:
        if error.code in (401, 403):
            return failed(
                NAME,
                f"GET {url}: {error.code}: the agent refused the token",
                "use an admin token of the pool (the admin: list of its tokens Secret)",
            )
        return failed(NAME, f"GET {url}: {error.code} {error.reason}", _SAME_RELEASE)
    except (urllib.error.URLError, OSError) as error:
        return failed(
            NAME,
            f"cannot reach {url}: {error}",
            "the Service's kvpool.io/http-port must be the agents' HTTP port (spec.ports.http)",
        )
    except ValidationError as error:
        return failed(NAME, f"GET {url} answered something else: {error}", _SAME_RELEASE)
    tenants = sorted(
        (usage for usage in usages if usage.tenant != CANARY_TENANT),
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


_SAME_RELEASE = "run a kvpool doctor of the agents' release (the route is GET /v1/tenants)"


def _described(usage: Usage) -> str:
    lookups = usage.hits + usage.misses
    rate = f" ({usage.hits / lookups:.0%})" if lookups else ""
    return (
        f"{usage.tenant}: {usage.hits} of {lookups} chunk lookups hit{rate}, "
        f"{usage.stored_chunks} stored, {usage.evicted_chunks} evicted"
    )
