"""AEGIS-128L (the CFRG's draft-irtf-cfrg-aegis-aead), detached, from the libsodium that
PyNaCl bundles.

The peer tier seals chunks with it where both ends read it: on CPUs with AES-NI but no
VAES (AVX2-only ones) it runs at the speed of a copy, where AES-GCM runs at less than
half of that (GHASH bounds it). PyNaCl declares only AEGIS's combined form (the tag
after the ciphertext); the detached one (the tag apart, so that a chunk lands and
opens in place in pages of its own size) is the same library's exported function,
declared here. cffi releases the GIL for the call, as AES-GCM's does.
"""

from __future__ import annotations

from typing import Any

import cffi
import nacl._sodium
import nacl.bindings

KEY_SIZE = 16
NONCE_SIZE = 16
TAG_SIZE = 32
"""libsodium's AEGIS-128L tag is the 256-bit one."""

_ffi = cffi.FFI()
_ffi.cdef(
    """
    int crypto_aead_aegis128l_encrypt_detached(
        unsigned char *c, unsigned char *mac, unsigned long long *maclen_p,
        const unsigned char *m, unsigned long long mlen,
        const unsigned char *ad, unsigned long long adlen,
        const unsigned char *nsec, const unsigned char *npub, const unsigned char *k);
    int crypto_aead_aegis128l_decrypt_detached(
        unsigned char *m, unsigned char *nsec,
        const unsigned char *c, unsigned long long clen, const unsigned char *mac,
        const unsigned char *ad, unsigned long long adlen,
        const unsigned char *npub, const unsigned char *k);
    size_t crypto_aead_aegis128l_abytes(void);
    """
)
nacl.bindings.sodium_init()  # picks the AES-NI implementation
_lib: Any = _ffi.dlopen(nacl._sodium.__file__)
assert _lib.crypto_aead_aegis128l_abytes() == TAG_SIZE
_NOTHING = _ffi.new("unsigned char[1]")
"""Where an empty message lies (and its empty ciphertext goes)."""


def seal_into(
    key: bytes, nonce: bytes, associated: bytes, payload: Any, *, out: Any, tag: Any
) -> None:
    """Encrypt ``payload`` into ``out`` (as long; they may be the same memory) and write
    the tag over ``associated`` and the payload into ``tag`` (:data:`TAG_SIZE` bytes)."""
    length = len(payload)
    if len(out) != length or len(tag) != TAG_SIZE:
        raise ValueError("the ciphertext's or the tag's buffer has the wrong size")
    _lib.crypto_aead_aegis128l_encrypt_detached(
        _ffi.from_buffer(out, require_writable=True),
        _ffi.from_buffer(tag, require_writable=True),
        _ffi.NULL,
        _ffi.from_buffer(payload),
        length,
        associated,
        len(associated),
        _ffi.NULL,
        nonce,
        key,
    )


def open_into(
    key: bytes, nonce: bytes, associated: bytes, body: Any, tag: bytes, *, out: Any
) -> bool:
    """Decrypt ``body`` into ``out`` (as long; they may be the same memory): whether the
    tag held (where it did not, ``out`` is zeroed by libsodium)."""
    length = len(body)
    if len(out) != length or len(tag) != TAG_SIZE:
        return False
    result = _lib.crypto_aead_aegis128l_decrypt_detached(
        _ffi.from_buffer(out, require_writable=True),
        _ffi.NULL,
        _ffi.from_buffer(body),
        length,
        tag,
        associated,
        len(associated),
        nonce,
        key,
    )
    return bool(result == 0)


def tag_into(key: bytes, nonce: bytes, data: Any, *, tag: Any) -> None:
    """Write the tag of ``data`` (authenticated as associated data, nothing encrypted)
    into ``tag`` (:data:`TAG_SIZE` bytes)."""
    if len(tag) != TAG_SIZE:
        raise ValueError("the tag's buffer has the wrong size")
    _lib.crypto_aead_aegis128l_encrypt_detached(
        _NOTHING,
        _ffi.from_buffer(tag, require_writable=True),
        _ffi.NULL,
        _NOTHING,
        0,
        _ffi.from_buffer(data),
        len(data),
        _ffi.NULL,
        nonce,
        key,
    )


def tag_matches(key: bytes, nonce: bytes, data: Any, tag: bytes) -> bool:
    """Whether ``tag`` is the tag of ``data`` (:func:`tag_into`)."""
    if len(tag) != TAG_SIZE:
        return False
    result = _lib.crypto_aead_aegis128l_decrypt_detached(
        _NOTHING, _ffi.NULL, _NOTHING, 0, tag, _ffi.from_buffer(data), len(data), nonce, key
    )
    return bool(result == 0)
