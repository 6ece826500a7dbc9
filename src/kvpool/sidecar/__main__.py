"""``kvpool-pd-sidecar`` (also ``python -m kvpool.sidecar``): says in one line if the
'sidecar' extra is missing, then runs :func:`kvpool.sidecar.main.main`."""

from __future__ import annotations

import sys

from kvpool.common.extras import require_extra


def main() -> int:
    require_extra("sidecar", "kvpool-pd-sidecar")
    from kvpool.sidecar.main import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())
