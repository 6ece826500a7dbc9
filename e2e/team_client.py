"""What a team's pod does with its KVCacheTenant's Secret, mounted at ``argv[1]``.

It reads its tenant id, token and the pool's endpoint from the Secret's files, reads its
usage with its token, sets its quota to ``argv[2]`` times the bytes it uses, tries
``argv[3]`` bytes (above its ceiling), and prints the agent's answers as JSON. Nothing
here was handed over by hand.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx


def main() -> None:
    secret, fraction, above = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])

    def read(key: str) -> str:
        return (secret / key).read_text().strip()

    tenant, endpoint = read("tenant-id"), read("endpoint")
    headers = {"Authorization": f"Bearer {read('token')}"}
    url = f"{endpoint}/v1/tenants/{tenant}"

    # a quota is written to the API server before it applies (the agent waits up to 10 s
    # there, then answers 503): wait longer than that, to see the agent's own answer
    timeout = 30

    def call(method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        response = httpx.request(method, url + path, json=body, headers=headers, timeout=timeout)
        response.raise_for_status()
        return response.json()

    before = call("GET", "/usage")
    quota = call("PUT", "/quota", {"limit_bytes": int(before["used_bytes"] * fraction)})
    after = call("GET", "/usage")
    refused = httpx.put(
        f"{url}/quota", json={"limit_bytes": above}, headers=headers, timeout=timeout
    )
    print(
        json.dumps(
            {
                "tenant": tenant,
                "before": before,
                "quota": quota,
                "after": after,
                "above_ceiling_status": refused.status_code,
            }
        )
    )


if __name__ == "__main__":
    main()
