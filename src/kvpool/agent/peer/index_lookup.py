"""Which peers hold a prefix, asked of the pool's prefix index (one request, not one per peer).

The index follows every agent's chunk events, so it answers for each node how long a run
of the keys it holds, the way :meth:`~kvpool.agent.peer.links.PeerLink.held` would. The
request carries the token this agent derives from the peer credential
(:func:`~kvpool.common.handshake.lookup_token`). The index may lag a store by the time
an event takes; a failed request (unreachable, refused, a bad answer) is None, and the
caller asks the peers themselves; for :data:`RETRY_SECONDS` after a failure the index is
not asked at all (an unreachable name can take seconds to fail).
"""

from __future__ import annotations

import http.client
import json
import logging
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

from kvpool.common.handshake import lookup_token
from kvpool.common.keyring import Keyring
from kvpool.common.web.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)
_failures = RateLimitedLog(log)

RETRY_SECONDS = 30.0


class IndexLookup:
    def __init__(self, url: str, keyring: Keyring, pool: str, timeout: float) -> None:
        parts = urlsplit(url)
        self.url = url
        self._host, self._port = parts.hostname or "", parts.port or 80
        self._keyring = keyring
        self._pool = pool
        self._timeout = timeout
        self._failed_at = -RETRY_SECONDS

    def held(self, keys: Sequence[bytes], nodes: Sequence[str]) -> dict[str, int] | None:
        """For each of ``nodes`` the index knows to hold the first of ``keys``, how many
        from the first it holds; None if the index could not say."""
        if time.monotonic() - self._failed_at < RETRY_SECONDS:
            return None
        found = self._ask(keys, nodes)
        if found is None:
            self._failed_at = time.monotonic()
        return found

    def _ask(self, keys: Sequence[bytes], nodes: Sequence[str]) -> dict[str, int] | None:
        current = self._keyring.current()
        token = lookup_token(current, current.active_id, self._pool)
        body = json.dumps(
            {"chunk_keys": [key.hex() for key in keys], "chunk_tokens": 1, "nodes": list(nodes)}
        )
        connection = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
        try:
            connection.request(
                "POST",
                "/v1/lookup",
                body,
                {"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            )
            response = connection.getresponse()
            answer = response.read()
            if response.status != 200:
                _failures.warning(f"the index at {self.url} answered {response.status}")
                return None
            matches = json.loads(answer)["matches"]
            return {str(match["node"]): int(match["chunks"]) for match in matches}
        except (OSError, ValueError, KeyError, TypeError) as error:
            _failures.warning(f"the index at {self.url} did not answer a lookup: {error}")
            return None
        finally:
            connection.close()
