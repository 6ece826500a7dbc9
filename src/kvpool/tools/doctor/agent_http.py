"""The agent's HTTP API read with an admin token, for the checks that need more than the
ZMQ port (hit-rate, peers): its answer, or the failed check that says why there is none."""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from kvpool.tools.doctor.report import Check, failed, skipped

Answer = TypeVar("Answer", bound=BaseModel)


def admin_get(
    name: str,
    route: str,
    answer: type[Answer],
    *,
    http_url: str | None,
    token: str | None,
    timeout: float,
    absent: Check | None = None,
) -> Answer | Check:
    """``GET <http_url><route>`` read as ``answer``; else check ``name`` skipped (no address
    or no token) or failed, naming why (or ``absent``, if given, when the agent answers
    404)."""
    if http_url is None:
        return skipped(name, "the agent's HTTP address is unknown (with --endpoint, give --http)")
    if token is None:
        return skipped(name, "no admin token (--admin-token-file, or KVPOOL_ADMIN_TOKEN)")
    url = f"{http_url}{route}"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    same_release = (
        f"run a kvpool doctor of the agents' release (the route is GET {route.partition('?')[0]})"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return answer.model_validate_json(response.read())
    except urllib.error.HTTPError as error:
        if error.code == 404 and absent is not None:
            return absent
        if error.code in (401, 403):
            return failed(
                name,
                f"GET {url}: {error.code}: the agent refused the token",
                "use an admin token of the pool (the admin: list of its tokens Secret)",
            )
        return failed(name, f"GET {url}: {error.code} {error.reason}", same_release)
    except (urllib.error.URLError, OSError) as error:
        return failed(
            name,
            f"cannot reach {url}: {error}",
            "the Service's kvpool.io/http-port must be the agents' HTTP port (spec.ports.http)",
        )
    except ValidationError as error:
        return failed(name, f"GET {url} answered something else: {error}", same_release)
