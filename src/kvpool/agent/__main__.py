"""``kvpool-agent`` (also ``python -m kvpool.agent``): says in one line if the
'agent' extra is missing, then runs :func:`kvpool.agent.main.main`."""

from __future__ import annotations

import sys

from kvpool.common.extras import require_extra


def main() -> int:
    require_extra("agent", "kvpool-agent")
    from kvpool.agent.main import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())
