"""Plain-text tables for benchmark output, and the figures every table shares.

Every table a bench makes is also kept, as data, while :func:`recording` runs (``kvpool
bench NAME --json`` prints them as JSON); a goal a figure missed is marked in its cell
(:func:`goal`); :func:`progress` tells standard error what a bench is doing; :func:`main`
runs a bench from its command line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from kvpool.common import problems

MISSED = "MISSED"
"""Beside a goal a figure did not reach, in its table."""
_recorded: list[list[dict[str, Any]]] = []


@contextlib.contextmanager
def recording() -> Iterator[list[dict[str, Any]]]:
    """Keep every table made in the block, as ``{"title", "header", "rows"}`` (cells as
    shown)."""
    tables: list[dict[str, Any]] = []
    _recorded.append(tables)
    try:
        yield tables
    finally:
        _recorded.remove(tables)


def progress(message: str) -> None:
    """One line on standard error: what the bench does now (its tables come at the end)."""
    print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def goal(shown: str, value: float, bound: float, *, at_least: bool = False) -> str:
    """A goal's cell: ``shown`` (``<= 1 us``), and :data:`MISSED` after it where ``value``
    is past ``bound`` (above it; below it with ``at_least``); at the bound, up to a ratio's
    rounding error, it is met."""
    past = value < bound if at_least else value > bound
    missed = past and not math.isclose(value, bound, rel_tol=1e-9)
    return f"{shown} {MISSED}" if missed else shown


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(cell) for cell in row] for row in [header, *rows]]
    for tables in _recorded:
        tables.append({"title": title, "header": cells[0], "rows": cells[1:]})
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(cells[0], widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells[1:]]
    return "\n".join(lines)


def median_spread(values: Sequence[float] | None, form: str, scale: float = 1.0) -> str:
    """The median of per-run figures, with their min-max when there are several runs."""
    if not values:
        return ""
    middle = form.format(statistics.median(values) * scale)
    if len(values) == 1:
        return middle
    return f"{middle} [{form.format(min(values) * scale)}-{form.format(max(values) * scale)}]"


def runs_said(count: int) -> str:
    """ "1 run", "3 runs": how many runs a table's figures come from."""
    return f"{count} run{'s' if count > 1 else ''}"


CPU_MASKS = ("OPENSSL_ia32cap", "GLIBC_TUNABLES")
"""Variables that hide CPU features from OpenSSL and glibc (a bench's ``--as-avx2``:
:mod:`kvpool.tools.bench.cpu_features`): the machine line names them where they are set."""


CIPHER_FEATURES = ("avx2", "avx512f", "vaes", "vpclmulqdq")
"""The x86 features that set the ciphers' speed (AES-GCM, L2's and older peers', is about four
times faster with the last three; AEGIS-128L needs AES-NI alone): the machine line says
which of them the CPU has."""


def machine() -> str:
    """The CPU and the load average: every bench names the machine its figures came from
    (the x86 features its cipher runs on, and any CPU features it was told to do without)."""
    cpu, flags = "unknown CPU", None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown CPU":
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and flags is None:
                flags = set(line.split(":", 1)[1].split())
    if flags is not None and "aes" in flags:
        has = [name for name in CIPHER_FEATURES if name in flags]
        lacks = [name for name in CIPHER_FEATURES if name not in flags]
        said = [" ".join(has)] if has else []
        said += [f"no {' '.join(lacks)}"] if lacks else []
        cpu += f" ({'; '.join(said)})"
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    line = f"CPU: {cpu}, {os.cpu_count()} CPUs; load average (1, 5, 15 min) at the end: {load}"
    masks = [f"{name}={os.environ[name]}" for name in CPU_MASKS if os.environ.get(name)]
    return line + (f"; CPU features masked: {' '.join(masks)}" if masks else "")


def add_chunk_mib(parser: argparse.ArgumentParser) -> None:
    """``--chunk-mib``: the chunk sizes of a bench that moves whole chunks (L2, peers), in
    MiB, a fraction for chunks under one (``0.25``: 256 KiB); read them with
    :func:`chunk_bytes`."""
    parser.add_argument(
        "--chunk-mib",
        type=_mebibytes,
        default=[2, 32],
        help="chunk sizes in MiB, comma-separated, 0.25 for 256 KiB (default 2,32)",
    )


def _mebibytes(text: str) -> list[float]:
    """Whole numbers stay ints (so that the command line reads as typed)."""
    return [int(value) if value.is_integer() else value for value in _sizes(text)]


_sizes = problems.numbers(float)


def chunk_bytes(mebibytes: float) -> int:
    """A ``--chunk-mib`` value in bytes (whole KiB)."""
    return round(mebibytes * 1024) << 10


def chunk_label(size: int) -> str:
    """``2 MiB``, ``256 KiB``: a chunk size as the tables show it."""
    return f"{size >> 20} MiB" if size % (1 << 20) == 0 else f"{size >> 10} KiB"


def command(program: str, args: argparse.Namespace) -> str:
    """The command line of this run of the bench ``program`` (``kvpool bench spaces``),
    every setting spelled out (a flag only where it is set, an option only where it has a
    value)."""
    words = program.split()
    for name, value in vars(args).items():
        option = f"--{name.replace('_', '-')}"
        if value is None:
            continue
        if isinstance(value, bool):
            words += [option] if value else []
        else:
            shown = ",".join(map(str, value)) if isinstance(value, list) else str(value)
            words += [option, shown]
    return "command: " + " ".join(words)


def main(
    program: str,
    description: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], None],
    argv: Sequence[str],
) -> int:
    """Run the bench ``program`` (``kvpool bench l1``) with the command line ``argv``: its
    own flags, and ``--json``, which prints the result as one JSON object."""
    tool = problems.ArgumentParser(prog=program, description=description)
    tool.add_argument(
        "--json",
        action="store_true",
        help="print the result as one JSON object on standard output: its tables (cells as "
        "shown) and its whole text, which goes to standard error",
    )
    add_arguments(tool)
    options = tool.parse_args(argv)
    progress(f"{program}: running; each table is printed when it is done")
    if not options.json:
        run(options)
        return 0
    text = io.StringIO()
    with recording() as tables, contextlib.redirect_stdout(_Tee(sys.stderr, text)):
        run(options)
    ran = " ".join([program, *argv])
    print(json.dumps({"command": ran, "tables": tables, "text": text.getvalue()}))
    return 0


class _Tee(io.TextIOBase):
    """Writes to each of ``streams``."""

    def __init__(self, *streams: TextIO) -> None:
        self._streams = streams

    def write(self, text: str) -> int:
        for stream in self._streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self._streams:
            stream.flush()
