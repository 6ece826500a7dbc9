"""The prefill pod a request names, and the prefill's request there.

A request names its prefill pod in :data:`~kvpool.common.disagg.PREFILL_HEADER`, signed by
the endpoint picker with the pool's key: the sidecar POSTs the client's prompt wherever the
header says, so an unsigned address would let any client make it send requests to any host
its network reaches (SSRF). A header that fails verification is never followed: the request
is served locally as if it had none, and the refusal logged (rate-limited, with a count).
llm-d's unsigned ``x-prefiller-host-port`` is followed only when the operator turns it on.

The prefill's outcome decides the decode: :class:`Prefilled` params (ok), a
:class:`Fallback` (the local vLLM computes the whole prompt: the prefill pod could not be
reached, timed out, failed with a 5xx, or answered no kvpool params), or a
:class:`Refused` request (a 4xx: the client's mistake, returned to it as is, as llm-d does).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass

import httpx

from kvpool.common.disagg import (
    PREFILL_HEADER,
    HeaderError,
    PrefillTarget,
    is_address,
    verify_prefill,
)
from kvpool.common.web.rate_limited_log import RateLimitedLog
from kvpool.sidecar.bodies import Prefilled, read_prefilled
from kvpool.sidecar.relay import Headers, returned
from kvpool.sidecar.settings import SidecarSettings

log = logging.getLogger(__name__)

LLMD_HEADER = "x-prefiller-host-port"
"""llm-d's unsigned choice of a prefill pod, ``host:port`` (``--llmd-header-compat``)."""
MAX_ANSWER_BYTES = 64 << 20
"""A prefill's answer read at most: its prompt token ids (chat) are a few MiB at most."""


def prefill_target(
    headers: Mapping[str, str], settings: SidecarSettings, now: float, flood_log: RateLimitedLog
) -> PrefillTarget | None:
    """The prefill pod the request's headers name and the sidecar may follow; None: serve
    it locally."""
    signed = headers.get(PREFILL_HEADER)
    if signed is not None and settings.key is not None:
        try:
            return verify_prefill(settings.key, signed, now)
        except HeaderError as error:
            # one line per kind of refusal, not per expiry age
            flood_log.warning(
                f"not following a prefill header: {re.sub(r'[0-9]+', 'N', str(error))}"
            )
    unsigned = headers.get(LLMD_HEADER)
    if unsigned is not None and settings.llmd_header_compat:
        if is_address(unsigned.strip()):
            return PrefillTarget(unsigned.strip(), "", 0)
        flood_log.warning(f"not following {LLMD_HEADER}: not a host:port")
    return None


@dataclass(frozen=True)
class Fallback:
    reason: str


@dataclass(frozen=True)
class Refused:
    """The prefill pod's 4xx, returned to the client as it came."""

    status: int
    headers: Headers
    body: bytes


async def prefill(
    client: httpx.AsyncClient,
    target: PrefillTarget,
    path: str,
    headers: Headers,
    body: dict[str, object],
    *,
    timeout_s: float,
    chat: bool,
) -> Prefilled | Fallback | Refused:
    """POST ``body`` to ``path`` on the prefill pod within ``timeout_s``, and what its answer
    gives the decode. Cancelled (the client left), its connection is closed, which aborts
    the prefill there."""
    content = json.dumps(body).encode()
    request = client.build_request(
        "POST",
        f"http://{target.address}{path}",
        headers=[
            *headers,
            (b"content-type", b"application/json"),
            (b"accept-encoding", b"identity"),  # its raw bytes are its JSON
        ],
        content=content,
    )
    try:
        async with asyncio.timeout(timeout_s):
            response = await client.send(request, stream=True)
            try:
                answer = await _read(response)
            finally:
                await response.aclose()
    except TimeoutError:
        return Fallback(f"no answer within {timeout_s:g} s")
    except httpx.HTTPError as error:
        return Fallback(f"{type(error).__name__}: {error}")
    if answer is None:
        return Fallback(f"an answer over {MAX_ANSWER_BYTES} bytes")
    if 400 <= response.status_code < 500:
        return Refused(response.status_code, returned(response, []), answer)
    if response.status_code >= 300:
        return Fallback(f"status {response.status_code}")
    try:
        prefilled = read_prefilled(json.loads(answer), chat=chat)
    except ValueError:
        return Fallback("an answer that is not JSON")
    if prefilled is None:
        return Fallback("no kvpool decode params in its answer (has it kvpool's connector?)")
    return prefilled


async def _read(response: httpx.Response) -> bytes | None:
    """The body, or None past :data:`MAX_ANSWER_BYTES`."""
    chunks, size = [], 0
    async for chunk in response.aiter_raw():
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            return None
        chunks.append(chunk)
    return b"".join(chunks)
