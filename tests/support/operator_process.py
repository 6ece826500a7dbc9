"""Kubernetes clients for tests: kubectl against the emulator, and a real kvpool-operator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from tests.support.polling import eventually
from tests.support.ports import free_port

BIN = Path(sys.executable).parent
REPO = Path(__file__).parents[2]


class Kubectl:
    def __init__(self, kubeconfig: Path) -> None:
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig)}

    def __call__(self, *args: str, manifest: dict[str, Any] | None = None) -> str:
        result = subprocess.run(
            ["kubectl", *args],
            input=yaml.safe_dump(manifest) if manifest is not None else None,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
        return result.stdout


class OperatorProcess:
    """``kvpool-operator`` for one namespace (None: every namespace), against a kubeconfig,
    with ``options`` added to its command line."""

    def __init__(
        self, kubeconfig: Path, namespace: str | None, log: Path, options: Sequence[str] = ()
    ) -> None:
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.log_path = log
        self.options = options
        self.liveness = f"http://127.0.0.1:{free_port()}/healthz"
        self._process: subprocess.Popen[bytes] | None = None
        self.startup = (0, 0)
        """Where in the log the latest start wrote, up to the operator's being alive (bytes)."""
        self._parsed: list[dict[str, Any]] = []
        self._parsed_up_to = 0

    def start(self) -> OperatorProcess:
        begun = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [
                    BIN / "kvpool-operator",
                    *(["--namespace", self.namespace] if self.namespace else ["--all-namespaces"]),
                    "--agent-image",
                    "kvpool:test",
                    "--liveness",
                    self.liveness,
                    "--retry-seconds",
                    "0.5",
                    *self.options,
                ],
                env={**os.environ, "KUBECONFIG": str(self.kubeconfig)},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        eventually(self._alive, timeout=30)
        self.startup = (begun, self.log_path.stat().st_size)
        return self

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def _alive(self) -> None:
        assert self._process is not None and self._process.poll() is None, self.log()
        try:
            with urllib.request.urlopen(self.liveness, timeout=1) as response:
                assert response.status == 200
        except OSError as error:
            raise AssertionError(f"not alive yet: {error}") from error

    def stop(self) -> int:
        """Stop it (if it runs); its exit status."""
        assert self._process is not None
        self._process.terminate()
        try:
            return self._process.wait(15)
        except subprocess.TimeoutExpired:
            self._process.kill()
            return self._process.wait()

    def log(self, start: int = 0, end: int | None = None) -> str:
        """The log, or the part of it from byte ``start`` (up to ``end``)."""
        with self.log_path.open("rb") as log:
            log.seek(start)
            data = log.read() if end is None else log.read(end - start)
        return data.decode(errors="replace")

    def log_size(self) -> int:
        """Where the log ends now (bytes): what a test reads its own part of the log from."""
        return self.log_path.stat().st_size

    def records(self) -> list[dict[str, Any]]:
        """The log's records (``--log-format json``: one object a line), read on from where
        the last call stopped (the log of an operator that many tests share grows long)."""
        with self.log_path.open("rb") as log:
            log.seek(self._parsed_up_to)
            data = log.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._parsed_up_to += len(complete)
        self._parsed += [
            json.loads(line)
            for line in complete.decode(errors="replace").splitlines()
            if line.startswith("{")
        ]
        return list(self._parsed)

    def handled(
        self, message: str, kind: str, name: str, since: int = 0, namespace: str | None = None
    ) -> int:
        """How many records from the ``since``-th on say ``message`` about the object ``kind``
        ``name`` (in ``namespace``, if given): the operator's own word that it handled an
        event, or stopped a daemon."""
        return sum(
            1
            for record in self.records()[since:]
            if record["message"].startswith(message)
            and (record.get("object") or {}).get("kind") == kind
            and record["object"].get("name") == name
            and namespace in (None, record["object"].get("namespace"))
        )
