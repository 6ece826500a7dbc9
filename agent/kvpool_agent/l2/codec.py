"""The header every L2 object carries, and its verification.

Layout (little-endian)::

    magic "KVPL2" | format version u8 | key[32] | tenant[32] | payload length u64
    | xxh3-64 of the payload u64 | payload

An object is served only if magic, version, key, tenant, length and checksum
all match what the reader asked for; anything else is an :class:`IntegrityError`.
"""

from __future__ import annotations

import struct

import xxhash

from kvpool_agent.l2.base import ObjectKey

MAGIC = b"KVPL2"
FORMAT_VERSION = 1
HEADER = struct.Struct("<5sB32s32sQQ")


class IntegrityError(ValueError):
    """The bytes are not the object that was asked for (or not intact)."""


def encode_header(name: ObjectKey, payload: bytes | memoryview) -> bytes:
    return HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        name.key,
        name.tenant.encode(),
        len(payload),
        xxhash.xxh3_64_intdigest(payload),
    )


def encode(name: ObjectKey, payload: bytes | memoryview) -> bytes:
    return encode_header(name, payload) + bytes(payload)


def decode(name: ObjectKey, blob: bytes | memoryview) -> bytes:
    """The payload of ``blob`` if it is intact and is ``name``; else :class:`IntegrityError`."""
    return verify(name, blob[: HEADER.size], bytes(blob[HEADER.size :]))


def verify(name: ObjectKey, header: bytes | memoryview, payload: bytes) -> bytes:
    """``payload`` if it and its ``header``, read apart, are intact and are ``name``.

    For readers that read the payload straight into the bytes they return: a copy
    of a large payload costs as much as reading it from a device.
    """
    if len(header) < HEADER.size:
        raise IntegrityError("shorter than the object header")
    magic, version, key, tenant, length, checksum = HEADER.unpack_from(header)
    if magic != MAGIC:
        raise IntegrityError("not a kvpool L2 object")
    if version != FORMAT_VERSION:
        raise IntegrityError(f"object format {version}; this build reads {FORMAT_VERSION}")
    if key != name.key or tenant.rstrip(b"\0") != name.tenant.encode():
        raise IntegrityError("the object belongs to another key or tenant")
    if len(payload) != length:
        raise IntegrityError(f"payload of {len(payload)} bytes, header says {length}")
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise IntegrityError("payload checksum mismatch")
    return payload
