"""What a chunk's protection costs the CPU, each pass measured alone: the part of the peer
bench's bound (:mod:`benchmarks.peer`) that the link's own figures do not hold.

A peer side moves a chunk at the CPU cost of its transport's raw rate (the plain socket's,
or NIXL raw's) plus the passes over the chunk that its protection needs, and no fewer:

* the sender: ``seal`` (sealed: the chunk encrypted into the send buffer, with AEGIS-128L
  as the agents seal for each other); with integrity, over TCP ``check_tag`` (its tag
  computed where it lies, the pass the receiver makes too), over NIXL ``copy_tag`` (the
  chunk copied into the staging buffer and its tag computed over the copy);
* the receiver: ``open_sealed`` (decrypted where it was received, or from a NIXL landing
  into L1) or ``check_tag`` (its tag computed where it lies; on NIXL also ``copy``, out of
  the landing first).

Each is the agents' own code (:class:`~kvpool.agent.l2.codec.ObjectCodec`) on one thread,
timed by that thread's CPU clock over buffers that do not fit the caches together (as a
chunk comes: from memory), median of several rounds. Run as a program (``python -m
benchmarks.peer_passes SIZE...``, printing JSON) so that it sees the CPU the agents see,
``--as-avx2`` included.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvpool.agent.l2.base import ObjectKey
from kvpool.agent.l2.buffers import BufferPool
from kvpool.agent.l2.codec import MAX_HEADER_SIZE, ObjectCodec
from kvpool.common.keyring import Keyring, generate_key

COLD_BYTES = 192 << 20
"""Buffers of at least this many bytes in all, taken in turn: more than a server's caches."""
ROUNDS = 5
TENANT = "bench-passes"


@dataclass(frozen=True)
class Passes:
    """CPU seconds per GB of each pass over a chunk of one size."""

    seal: float
    copy_tag: float
    open_sealed: float
    check_tag: float
    copy: float

    def per_gb(self, transport: str, protection: str) -> float:
        """Both sides' passes together, for a side of ``transport`` and ``protection``."""
        nixl = transport == "nixl"
        if protection == "sealed":  # on NIXL too: it opens from the landing into L1
            return self.seal + self.open_sealed
        sender = self.copy_tag if nixl else self.check_tag  # over TCP it goes from L1
        return sender + self.check_tag + (self.copy if nixl else 0.0)


def measure(sizes: Sequence[int]) -> dict[int, Passes]:
    """Each size's passes, measured in a process of their own (started with this one's
    environment)."""
    command = [sys.executable, "-m", "benchmarks.peer_passes", *map(str, sizes)]
    checkout = Path(__file__).resolve().parents[1]  # its errors go to this one's stderr
    output = subprocess.run(
        command, stdout=subprocess.PIPE, text=True, check=True, cwd=checkout
    ).stdout
    return {int(size): Passes(**fields) for size, fields in json.loads(output).items()}


def passes_of(size: int) -> Passes:
    """The passes over chunks of ``size`` bytes, on this thread."""
    with tempfile.TemporaryDirectory(prefix="kvpool-passes-") as keys:
        generate_key(Path(keys))
        keyring = Keyring(Path(keys), reload_seconds=math.inf)
    codecs = {
        seal: ObjectCodec(keyring, "bench", seal=seal, buffers=BufferPool(), aegis=True)
        for seal in (True, False)
    }
    key_id = keyring.current().active_id
    count = max(2, math.ceil(COLD_BYTES / 3 / size))
    chunks = [memoryview(os.urandom(size)) for _ in range(count)]
    sent = [memoryview(bytearray(MAX_HEADER_SIZE + size)) for _ in range(count)]
    landed = [memoryview(bytearray(size)) for _ in range(count)]
    names = [ObjectKey(TENANT, hashlib.sha256(b"%d" % n).digest()) for n in range(count)]
    seconds: dict[str, list[float]] = {field: [] for field in Passes.__dataclass_fields__}

    def timed(field: str, step: Callable[[int], object]) -> None:
        started = time.thread_time()
        for n in range(count):
            step(n)
        seconds[field].append((time.thread_time() - started) / (count * size) * 1e9)

    def encoding(codec: ObjectCodec) -> Callable[[int], None]:
        end = codec.header_size + size
        return lambda n: codec.encode_into(names[n], chunks[n], sent[n][:end], key_id)

    def copying(codec: ObjectCodec) -> Callable[[int], None]:
        header, end = codec.header_size, codec.header_size + size

        def copy(n: int) -> None:
            landed[n][:] = sent[n][header:end]

        return copy

    def opening(codec: ObjectCodec) -> Callable[[int], object]:
        header = codec.header_size
        return lambda n: codec.open(names[n], sent[n][:header], landed[n], in_place=True)

    for _ in range(ROUNDS):
        for seal, encoded, opened in (
            (True, "seal", "open_sealed"),
            (False, "copy_tag", "check_tag"),
        ):
            timed(encoded, encoding(codecs[seal]))
            timed("copy", copying(codecs[seal]))
            timed(opened, opening(codecs[seal]))
    return Passes(**{field: statistics.median(values) for field, values in seconds.items()})


def main(argv: Sequence[str] | None = None) -> None:
    sizes = [int(size) for size in (sys.argv[1:] if argv is None else argv)]
    print(json.dumps({size: asdict(passes_of(size)) for size in sizes}))


if __name__ == "__main__":
    main()
