"""``kvpool-csi`` (also ``python -m kvpool.csi``): says in one line if the
'csi' extra is missing, then runs :func:`kvpool.csi.main.main`."""

from __future__ import annotations

import sys

from kvpool.common.extras import require_extra


def main() -> int:
    require_extra("csi", "kvpool-csi")
    from kvpool.csi.main import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())
