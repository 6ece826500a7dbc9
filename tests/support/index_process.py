"""Run a real ``kvpool-index`` process for tests: static agents, a tokens file, its URL."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import yaml

from kvpool.common.keys import ModelFingerprint, tenant_id
from tests.support.agent_process import INDEX_TOKEN

BIN = Path(sys.executable).parent
READY = re.compile(r"index ready pool=\S+ http=(\S+)")
GATEWAY_TOKEN = "gateway-token-for-tests-7e3a91c4f05b2d68"
ADMIN_TOKEN = "index-admin-token-for-tests-c28f4b61e9a703d5"
TENANT_TOKEN = "tenant-token-for-tests-19d6e2a8b47f0c53"
FINGERPRINT = ModelFingerprint("test-model", "bfloat16", "NHD", chunk_tokens=16)
SALT = "alice-salt"


class Endpoints(Protocol):
    zmq: str
    events: str


class IndexProcess:
    def __init__(
        self,
        workdir: Path,
        agents: Mapping[str, Endpoints],
        settings: Mapping[str, str] | None = None,
        *,
        tokens_file: bool = True,
    ) -> None:
        """``settings`` become KVPOOL_INDEX_* environment variables; without ``tokens_file``
        the index generates its admin token into ``workdir/state``."""
        workdir.mkdir(exist_ok=True)
        tokens = workdir / "tokens.yaml"
        tokens.write_text(
            yaml.safe_dump(
                {
                    "admins": [ADMIN_TOKEN],
                    "gateways": [GATEWAY_TOKEN],
                    "tenants": {tenant_id(SALT): TENANT_TOKEN},
                }
            )
        )
        agent_token = workdir / "agent-token"
        agent_token.write_text(INDEX_TOKEN + "\n")
        environment = {
            **os.environ,
            "KVPOOL_INDEX_AGENT_TOKEN_FILE": str(agent_token),
            "KVPOOL_INDEX_HTTP_PORT": "0",
            "KVPOOL_INDEX_STATE_DIR": str(workdir / "state"),
            "KVPOOL_INDEX_FINGERPRINT": json.dumps(
                {"model": "test-model", "dtype": "bfloat16", "kv_layout": "NHD", "chunk_tokens": 16}
            ),
            **{f"KVPOOL_INDEX_{name}": value for name, value in (settings or {}).items()},
        }
        if tokens_file:
            environment["KVPOOL_INDEX_TOKENS_FILE"] = str(tokens)
        arguments = [f"--agent={node}={a.zmq},{a.events}" for node, a in agents.items()]
        self.log: list[str] = []
        self.url = ""
        self.process = subprocess.Popen(
            [BIN / "kvpool-index", *arguments],
            env=environment,
            stderr=subprocess.PIPE,
            text=True,
        )
        ready = threading.Event()
        threading.Thread(target=self._read_log, args=(ready,), daemon=True).start()
        assert ready.wait(30) and self.url, "index did not start:\n" + "".join(self.log)

    def _read_log(self, ready: threading.Event) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line)
            if match := READY.search(line):
                self.url = match.group(1)
                ready.set()
        ready.set()

    def status(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as answer:
                return int(answer.status)
        except urllib.error.HTTPError as error:
            return error.code

    def get(self, path: str, token: str | None = None) -> str:
        request = urllib.request.Request(self.url + path)
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=5) as answer:
            return str(answer.read().decode())

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(15)
