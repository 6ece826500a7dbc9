"""The check every console script makes first: is its part's extra installed?

The base distribution holds the connector and the client; the agent, the operator and the
prefix index each need an extra (``pip install 'kvpool[agent]'``). A script of a part whose
extra is missing says so in one line instead of failing on its first import.
"""

from __future__ import annotations

import importlib.metadata

from packaging.requirements import Requirement

from kvpool import __version__

DISTRIBUTION = "kvpool"


def missing_requirements(extra: str) -> list[str]:
    """The requirements of ``extra`` that are not installed (or not in a matching version)."""
    try:
        requirements = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return []  # run from a source tree, not an installed distribution: nothing declared
    missing = []
    for line in requirements:
        requirement = Requirement(line)
        if requirement.marker is None or not requirement.marker.evaluate({"extra": extra}):
            continue  # the base's (installed with the package) or another extra's
        if requirement.name == DISTRIBUTION:  # an extra made of others: kvpool[agent]
            for other in sorted(requirement.extras):
                missing.extend(missing_requirements(other))
            continue
        try:
            version = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(requirement.name)
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            missing.append(f"{requirement.name} {version} (needs {requirement.specifier})")
    return missing


def require_extra(extra: str, command: str) -> None:
    """Exit with one line naming the extra to install if ``extra`` is not installed."""
    missing = missing_requirements(extra)
    if missing:
        raise SystemExit(
            f"{command} needs kvpool's '{extra}' extra (missing: {', '.join(missing)}); "
            f"install kvpool with it from its wheel or a checkout: pip install "
            f"'kvpool-{__version__}-py3-none-any.whl[{extra}]' (docs/platform/install.md)"
        )
