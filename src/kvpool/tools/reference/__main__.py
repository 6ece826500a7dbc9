"""``python -m kvpool.tools.reference [--docs DIR] [--check] [PAGE ...]``."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from kvpool.common.problems import ArgumentParser
from kvpool.tools.reference.pages import COMMAND, PAGES


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(
        prog=COMMAND, description="Write or check the generated reference pages."
    )
    parser.add_argument(
        "--docs", type=Path, default=Path("docs"), help="the docs directory (default: docs)"
    )
    parser.add_argument("--check", action="store_true", help="fail, naming each stale page")
    parser.add_argument("pages", nargs="*", help="only these pages (reference/settings.md ...)")
    args = parser.parse_args(argv)
    chosen = [page for page in PAGES if not args.pages or page.path in args.pages]
    stale = []
    for page in chosen:
        target = args.docs / page.path
        text = page.text()
        if target.exists() and target.read_text() == text:
            continue
        if args.check:
            stale.append(str(target))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}; run {COMMAND}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
