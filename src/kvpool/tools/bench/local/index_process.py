"""Run a real ``kvpool-index`` process: static agents, a tokens file, its URL once ready."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import yaml

from kvpool.tools.bench.local.agent_process import BIN, INDEX_TOKEN

READY = re.compile(r"index ready pool=\S+ http=(\S+) discovery=\S+ picker=(\S+)")


class Endpoints(Protocol):
    """An agent as the index follows it: its ZMQ API and its events."""

    zmq: str
    events: str


class IndexProcess:
    """``kvpool-index`` following ``agents`` (node name -> endpoints), keyed by
    ``fingerprint``, with the tokens file ``tokens`` (``admins``, ``gateways``, ``tenants``;
    None: the index generates its admin token into ``workdir/state``); ``settings`` become
    KVPOOL_INDEX_* environment variables. It runs in this machine's network namespace."""

    def __init__(
        self,
        workdir: Path,
        agents: Mapping[str, Endpoints],
        fingerprint: Mapping[str, Any],
        tokens: Mapping[str, Any] | None,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        workdir.mkdir(exist_ok=True)
        agent_token = workdir / "agent-token"
        agent_token.write_text(INDEX_TOKEN + "\n")
        environment = {
            **os.environ,
            "KVPOOL_INDEX_AGENT_TOKEN_FILE": str(agent_token),
            "KVPOOL_INDEX_HTTP_PORT": "0",
            "KVPOOL_INDEX_STATE_DIR": str(workdir / "state"),
            "KVPOOL_INDEX_FINGERPRINT": json.dumps(dict(fingerprint)),
            **{f"KVPOOL_INDEX_{name}": value for name, value in (settings or {}).items()},
        }
        if tokens is not None:
            tokens_file = workdir / "tokens.yaml"
            tokens_file.write_text(yaml.safe_dump(dict(tokens)))
            environment["KVPOOL_INDEX_TOKENS_FILE"] = str(tokens_file)
        arguments = [f"--agent={node}={a.zmq},{a.events}" for node, a in agents.items()]
        self.log: list[str] = []
        self.url = ""
        self.picker = ""
        """``host:port`` of its endpoint picker (``off``: none)."""
        self.process = subprocess.Popen(
            [BIN / "kvpool-index", *arguments],
            env=environment,
            stderr=subprocess.PIPE,
            text=True,
        )
        ready = threading.Event()
        threading.Thread(target=self._read_log, args=(ready,), daemon=True).start()
        if not ready.wait(30) or not self.url:
            self.process.kill()
            raise RuntimeError("the index did not start:\n" + "".join(self.log))

    def _read_log(self, ready: threading.Event) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line)
            if match := READY.search(line):
                self.url, self.picker = match.group(1), match.group(2)
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
