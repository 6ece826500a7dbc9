"""An AVX-512 machine measuring what an x86 CPU with AVX2 and no more would (``--as-avx2``).

L2's objects, and the peer tier's chunks to agents of older builds, are sealed with
OpenSSL's AES-GCM, which runs about four times slower on AES-NI, PCLMULQDQ and AVX2 alone
than with AVX-512, VAES and VPCLMULQDQ (docs/platform/peers.md, "Figures"), and a pool's
nodes have either kind of CPU. (The peer tier's AEGIS-128L, libsodium's, runs on AES-NI
alone: the masks leave it as it is.) A bench told
``--as-avx2`` starts every process it measures (the agents and what they are compared
with: the plain socket, NIXL raw) with OpenSSL told those features are absent
(``OPENSSL_ia32cap``), and glibc's string functions too (``GLIBC_TUNABLES``), so that one
run on one machine gives both kinds' figures. The rest of the CPU stays as it is (its
clock, caches and memory): an approximation of an AVX2-only CPU, not one; every bench's
machine line (:func:`~kvpool.tools.bench.report.machine`) names the masks it ran with.
"""

from __future__ import annotations

import argparse
import os

_LEAF7_EBX = {"AVX512F": 16, "AVX512DQ": 17, "AVX512IFMA": 21, "AVX512PF": 26}
_LEAF7_EBX |= {"AVX512ER": 27, "AVX512CD": 28, "AVX512BW": 30, "AVX512VL": 31}
_LEAF7_ECX = {"AVX512VBMI": 1, "AVX512VBMI2": 6, "VAES": 9, "VPCLMULQDQ": 10}
_LEAF7_ECX |= {"AVX512VNNI": 11, "AVX512BITALG": 12, "AVX512VPOPCNTDQ": 14}
_MASKED = sum(1 << bit for bit in _LEAF7_EBX.values()) | sum(
    1 << (32 + bit) for bit in _LEAF7_ECX.values()
)
"""OpenSSL's second capability word is CPUID leaf 7's EBX, then its ECX."""
AVX2_ONLY = {
    "OPENSSL_ia32cap": f":~{_MASKED:#x}",
    "GLIBC_TUNABLES": "glibc.cpu.hwcaps=" + ",".join(f"-{name}" for name in _LEAF7_EBX),
}
"""The environment of a process that is to see no AVX-512, VAES or VPCLMULQDQ."""


def add_as_avx2(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--as-avx2",
        action="store_true",
        help="measure as an AVX2-only x86 CPU: OpenSSL and glibc told there is no AVX-512, "
        "VAES or VPCLMULQDQ",
    )


def take(args: argparse.Namespace) -> None:
    """Where ``--as-avx2`` was given, every process started from now on sees an AVX2-only
    CPU."""
    if args.as_avx2:
        os.environ.update(AVX2_ONLY)
