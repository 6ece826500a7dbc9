"""``kvpool-operator``: entry point of the kopf operator."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvpool-operator",
        description="Reconcile KVCachePool resources into DaemonSets of kvpool agents.",
    )
    parser.parse_args(argv)
    print(
        "kvpool-operator: the reconciler is not built yet (tracked as the operator issue); "
        "run agents directly with kvpool-agent.",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
