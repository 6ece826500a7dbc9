"""``kvpool-index`` (also ``python -m kvpool.index``): says in one line if the
'index' extra is missing, then runs :func:`kvpool.index.server.main`."""

from __future__ import annotations

import sys

from kvpool.common.extras import require_extra


def main() -> int:
    require_extra("index", "kvpool-index")
    from kvpool.index.server import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())
