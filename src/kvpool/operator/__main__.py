"""``kvpool-operator`` (also ``python -m kvpool.operator``): says in one line if the
'operator' extra is missing, then runs :func:`kvpool.operator.main.main`."""

from __future__ import annotations

import sys

from kvpool.common.extras import require_extra


def main() -> int:
    require_extra("operator", "kvpool-operator")
    from kvpool.operator.main import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())
