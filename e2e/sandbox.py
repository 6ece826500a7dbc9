"""The inside of an emulated pod: mount its volumes where its spec says, then run it.

Started by :class:`e2e.cluster.Kubelet` as::

    nsenter --mount=NODE -- unshare --mount --propagation private python e2e/sandbox.py SPEC

in a mount namespace of its own, made from its node's (``NODE``), so that nothing it
mounts is seen outside; a CSI plugin's pod starts with ``--propagation unchanged``, so
that what it mounts under the node's shared kubelet directory reaches the node. ``SPEC``
is a JSON file: ``mounts`` (``[source, target, read_only]``: a host directory or file shown
at ``target``), ``argv``, ``env``, ``workdir`` and ``scratch`` (a directory for overlay
layers). A target that does not exist (``/etc/kvpool/config``) is made inside an overlay
of its nearest existing ancestor (``/etc``), whose upper layer lives in ``scratch``: the
host's file system is never changed. Only the standard library: this runs before
anything is set up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def _mount(*args: str) -> None:
    result = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"sandbox: mount {' '.join(args)}: {result.stderr.strip()}")


class _Overlays:
    def __init__(self, scratch: Path) -> None:
        self._scratch = scratch
        self._done: set[Path] = set()

    def make(self, target: Path, is_file: bool) -> None:
        """Make ``target`` exist, in an overlay where the host lacks it."""
        if target.exists():
            return
        ancestor = target.parent
        while not ancestor.exists():
            ancestor = ancestor.parent
        ancestor = ancestor.resolve()  # /var/run is /run
        if ancestor not in self._done and not any(d in ancestor.parents for d in self._done):
            layer = self._scratch / f"overlay-{len(self._done)}"
            (layer / "upper").mkdir(parents=True)
            (layer / "work").mkdir()
            options = f"lowerdir={ancestor},upperdir={layer / 'upper'},workdir={layer / 'work'}"
            _mount("-t", "overlay", "overlay", "-o", options, str(ancestor))
            self._done.add(ancestor)
        if is_file:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()
        else:
            target.mkdir(parents=True, exist_ok=True)


def _covers(target: Path, path: Path) -> bool:
    return path == target or target in path.parents


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    overlays = _Overlays(Path(spec["scratch"]))
    mounts = [
        (Path(source), Path(target), read_only) for source, target, read_only in spec["mounts"]
    ]
    # every mount point first (an overlay made later would hide earlier mounts), then the
    # mounts, those that hide other mounts' sources (a node's /dev/shm) last
    for source, target, _ in mounts:
        overlays.make(target, source.is_file())
    sources = [source for source, _, _ in mounts]
    mounts.sort(key=lambda mount: sum(_covers(mount[1], source) for source in sources))
    for source, target, read_only in mounts:
        _mount("--bind", str(source), str(target))
        if read_only:
            _mount("-o", "remount,bind,ro", str(target))
    os.chdir(spec.get("workdir") or "/")
    argv = spec["argv"]
    os.execvpe(argv[0], argv, spec["env"])


if __name__ == "__main__":
    main()
