"""The request headers of prefill/decode disaggregation: what names the prefill pod to
the decode pod's sidecar.

A disaggregated pick's request carries :data:`~kvpool.common.disagg.PREFILL_HEADER`, the
prefill pod signed with the pool's key for ``header_ttl_seconds`` (and, with
``llmd_header``, llm-d's unsigned :data:`LLMD_HEADER`); every other request has them
removed. A client must never choose where a sidecar sends its prompt: a signature it cannot
make guards kvpool's header, and removing it keeps a replayed one from being followed;
llm-d's header has only the removal.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvpool.common.disagg import PREFILL_HEADER, PrefillTarget, sign_prefill
from kvpool.common.index_config import PrefillDecode
from kvpool.common.web.rate_limited_log import RateLimitedLog
from kvpool.index.epp.answers import HeaderChanges
from kvpool.index.picking import Pick, PickReason

log = logging.getLogger(__name__)
_rare = RateLimitedLog(log)

LLMD_HEADER = "x-prefiller-host-port"
"""llm-d's routing sidecar's header: ``host:port`` of the prefill pod, unsigned."""


class PrefillHeaders:
    """Signs a disaggregated pick's prefill pod; removes the headers from other requests."""

    def __init__(
        self,
        key: bytes | None,
        config: PrefillDecode,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``key``: the pool's disaggregation key (None without ``picker.pd``: no pick
        names a prefill pod then)."""
        self._key = key
        self._ttl = config.header_ttl_seconds
        self._clock = clock
        self._llmd = config.llmd_header
        self._colocated = HeaderChanges(
            remove=(PREFILL_HEADER, LLMD_HEADER) if self._llmd else (PREFILL_HEADER,)
        )

    def route(self, pick: Pick) -> tuple[Pick, HeaderChanges]:
        """The pick as routed, and its request's header changes. A prefill pod that cannot
        be signed for (an address or node the header cannot carry, no key) is logged and
        the request goes whole to its decode pod, reason ``fail_open`` (chosen by load)."""
        prefill = pick.prefill
        if prefill is None:
            return pick, self._colocated
        target = PrefillTarget(prefill.address, prefill.node, int(self._clock()) + self._ttl)
        try:
            if self._key is None:
                raise ValueError("the edge has no disaggregation key")
            headers = [(PREFILL_HEADER, sign_prefill(self._key, target))]
        except ValueError as error:
            _rare.warning(f"prefill pod {prefill.address} not named to the decode pod: {error}")
            return Pick(pick.endpoint, PickReason.FAIL_OPEN), self._colocated
        if self._llmd:
            headers.append((LLMD_HEADER, prefill.address))
        return pick, HeaderChanges(set=headers)
