"""Sealing: what is stored, what opens, rotation, server-side encryption.

The codec is exercised through the adapters against real files and moto's HTTP
server; the bucket's bytes are read back with a raw boto3 client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from kvpool.agent.l2 import L2Object, ObjectKey
from kvpool.agent.l2 import aegis as aegis_128l
from kvpool.agent.l2.codec import (
    AEGIS_FORMAT_VERSION,
    AEGIS_HEADER,
    FORMAT_VERSION,
    HEADER,
    NONCE_SIZE,
    IntegrityError,
    ObjectCodec,
    header_size,
    opens_in_one_read,
    payload_length,
)
from kvpool.agent.l2.nvme import NvmeAdapter
from kvpool.agent.l2.s3 import S3Adapter

from .conftest import (
    POOL,
    MiB,
    chunk,
    nvme_config,
    object_codec,
    payload,
    raw_client,
    s3_config,
    write_key,
)

pytestmark = pytest.mark.asyncio

KEY_1, KEY_2 = b"1" * 64, b"2" * 64


def codec(keys: Path, pool: str = POOL, *, seal: bool = True, aegis: bool = False) -> ObjectCodec:
    """A sealing codec that rereads its keys at every use (rotation takes effect at once)."""
    return object_codec(keys, pool, seal=seal, reload_seconds=0, aegis=aegis)


FORMATS = pytest.mark.parametrize(
    ("seal", "aegis"),
    [(True, False), (False, False), (True, True), (False, True)],
    ids=["sealed", "integrity", "aegis-sealed", "aegis-integrity"],
)
"""Format 2 (AES-GCM) and format 3 (AEGIS-128L), each sealed and authenticated."""


S3Factory = Callable[..., S3Adapter]


@pytest_asyncio.fixture
async def s3(s3_endpoint: str, bucket: str) -> AsyncIterator[S3Factory]:
    made: list[S3Adapter] = []

    def factory(keys: Path, pool: str = POOL, seal: bool = True, **settings: Any) -> S3Adapter:
        config = s3_config(s3_endpoint, bucket, encryption=seal, **settings)
        made.append(S3Adapter(config, pool, codec(keys, pool, seal=seal)))
        return made[-1]

    yield factory
    for adapter in made:
        await adapter.close()


def stored_object(adapter: S3Adapter, endpoint: str, name: ObjectKey) -> bytes:
    raw = raw_client(endpoint)
    return raw.get_object(Bucket=adapter.config.bucket, Key=adapter.object_key(name))["Body"].read()


@pytest.mark.parametrize("seal", [True, False], ids=["sealed", "plain"])
@pytest.mark.process
async def test_the_bucket_holds_no_plaintext_of_a_sealed_tier(
    s3: S3Factory, s3_endpoint: str, tmp_path: Path, seal: bool
) -> None:
    write_key(tmp_path / "keys", 1, KEY_1)
    adapter = s3(tmp_path / "keys", seal=seal)
    names, data = [chunk(0), chunk(1)], [payload(4096, "a"), payload(9 * MiB, "b")]  # b: multipart
    assert await adapter.put([L2Object(n, d) for n, d in zip(names, data, strict=True)]) == [
        True,
        True,
    ]
    for name, plain in zip(names, data, strict=True):
        blob = stored_object(adapter, s3_endpoint, name)
        probe = plain[1000:1064]  # any 64 bytes of the chunk
        assert (probe in blob) is not seal
    assert await adapter.get(names) == data


@pytest.mark.process
async def test_server_side_encryption_reaches_every_put(
    s3: S3Factory, s3_endpoint: str, tmp_path: Path
) -> None:
    write_key(tmp_path / "keys", 1, KEY_1)
    raw = raw_client(s3_endpoint)
    for settings, expected in [
        ({"server_side_encryption": "AES256"}, {"ServerSideEncryption": "AES256"}),
        (
            {"server_side_encryption": "aws:kms", "sse_kms_key_id": "alias/kvpool"},
            {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "alias/kvpool"},
        ),
    ]:
        adapter = s3(tmp_path / "keys", **settings)
        names = [chunk(f"{settings}-small"), chunk(f"{settings}-multipart")]
        await adapter.put([L2Object(names[0], b"x" * 100), L2Object(names[1], b"y" * 9 * MiB)])
        for name in names:
            head = raw.head_object(Bucket=adapter.config.bucket, Key=adapter.object_key(name))
            assert {field: head.get(field) for field in expected} == expected


@pytest.mark.process
async def test_another_pool_or_master_key_opens_nothing(s3: S3Factory, tmp_path: Path) -> None:
    """Same bucket, prefix, tenant and chunk key: only the pool (or the key) differs."""
    write_key(tmp_path / "keys", 1, KEY_1)
    write_key(tmp_path / "other-keys", 1, KEY_2)
    name, data = chunk(0), payload(5000)
    writer = s3(tmp_path / "keys", pool=POOL)
    assert await writer.put([L2Object(name, data)]) == [True]
    # A reader of another pool looking at the writer's object (its key made to match).
    other_pool = s3(tmp_path / "keys", pool="other-pool")
    other_pool.object_key = writer.object_key  # type: ignore[method-assign]
    other_key = s3(tmp_path / "other-keys", pool=POOL)
    same = s3(tmp_path / "keys", pool=POOL)
    assert await other_pool.get([name]) == [None]
    assert await other_key.get([name]) == [None]
    assert await same.get([name]) == [data]
    assert other_pool.stats.integrity_failures == other_key.stats.integrity_failures == 1


async def test_rotation_old_objects_open_until_their_key_is_removed(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    write_key(keys, 1, KEY_1)
    adapter = NvmeAdapter(nvme_config(tmp_path / "l2"), POOL, lambda tenant: None, codec(keys))
    old, new = chunk("old"), chunk("new")
    assert await adapter.put([L2Object(old, b"old" * 1000)]) == [True]
    write_key(keys, 2, KEY_2)  # the Secret gains key 2: new objects are sealed under it
    assert await adapter.put([L2Object(new, b"new" * 1000)]) == [True]
    assert [_key_id(adapter.path_of(n).read_bytes()) for n in (old, new)] == [1, 2]
    assert await adapter.get([old, new]) == [b"old" * 1000, b"new" * 1000]
    (keys / "1").unlink()  # key 1 retired: its objects are misses, and go
    # one read at a time: of two concurrent reads, one may use the keys while the other
    # rereads them (the reread never blocks a read), which is what a running agent wants
    assert await adapter.get([old]) == [None]
    assert await adapter.get([new]) == [b"new" * 1000]
    assert not adapter.path_of(old).exists()
    await adapter.close()


def _key_id(blob: bytes) -> int:
    return int(HEADER.unpack_from(blob)[3])


@pytest.mark.parametrize("aegis", [False, True], ids=["aes-gcm", "aegis"])
async def test_each_object_has_its_own_nonce(tmp_path: Path, aegis: bool) -> None:
    write_key(tmp_path / "keys", 1, KEY_1)
    sealer = codec(tmp_path / "keys", aegis=aegis)
    name, data = chunk(0), payload(1000)
    with sealer.encode(name, data) as (head_1, body):
        body_1 = bytes(body)
    with sealer.encode(name, data) as (head_2, body):
        body_2 = bytes(body)
    nonce = slice(*((99, 115) if aegis else (83, 83 + NONCE_SIZE)))
    assert len(head_1) == sealer.header_size == (AEGIS_HEADER if aegis else HEADER).size
    assert head_1[nonce] != head_2[nonce] and body_1 != body_2
    assert sealer.open(name, head_1, body_1) == sealer.open(name, head_2, body_2) == data


async def test_a_header_field_changed_by_one_bit_does_not_open(tmp_path: Path) -> None:
    """Every header byte is covered: format, flags, key id, key, tenant, length, nonce, tag."""
    write_key(tmp_path / "keys", 1, KEY_1)
    write_key(tmp_path / "keys", 2, KEY_2)
    for seal, aegis in ((True, False), (False, False), (True, True), (False, True)):
        sealer = codec(tmp_path / "keys", seal=seal, aegis=aegis)
        name, data = ObjectKey("t", bytes(32)), payload(300)
        with sealer.encode(name, data) as (header, sealed):
            body = bytes(sealed)
        for index in range(len(header)):
            forged = bytearray(header)
            forged[index] ^= 0x01
            # The reader asks for what the forged header names, so only the tag can refuse it.
            tenant = forged[43:75].rstrip(b"\0").decode(errors="replace")
            with pytest.raises(IntegrityError):
                sealer.open(ObjectKey(tenant, bytes(forged[11:43])), bytes(forged), body)


@FORMATS
async def test_an_object_built_in_place_opens_as_one_built_apart(
    tmp_path: Path, seal: bool, aegis: bool
) -> None:
    """The peer server builds an object straight into NIXL's send buffer (encode_into):
    the same format as encode, and a flipped byte anywhere in it does not open."""
    write_key(tmp_path / "keys", 1, KEY_1)
    sealer = codec(tmp_path / "keys", seal=seal, aegis=aegis)
    name, data = chunk(0), payload(1000)
    header = sealer.header_size
    built = memoryview(bytearray(header + len(data)))
    sealer.encode_into(name, data, built, 1)
    assert sealer.decode(name, bytes(built)) == data
    with sealer.encode(name, data, 1) as (apart, body):
        assert apart[:6] == built[:6] and len(apart) == header
        assert sealer.open(name, apart, bytes(body)) == data
    assert (bytes(built[header:]) == data) == (not seal)  # sealed: no plaintext
    for index in (0, header - 1, header, len(built) - 1):
        forged = bytearray(built)
        forged[index] ^= 0x01
        with pytest.raises(IntegrityError):
            sealer.decode(name, bytes(forged))


@FORMATS
@pytest.mark.parametrize("where", ["in_place", "out", "new"])
async def test_every_format_opens_in_every_codec_of_the_pool(
    tmp_path: Path, seal: bool, aegis: bool, where: str
) -> None:
    """A reader opens format 2 and format 3 whatever it writes (a peer of the other
    build in a rollout), in place, into pages of its own, or into new bytes."""
    write_key(tmp_path / "keys", 1, KEY_1)
    writer = codec(tmp_path / "keys", seal=seal, aegis=aegis)
    name, data = chunk(0), payload(5000)
    with writer.encode(name, data) as (header, body):
        sent = bytes(body)
    assert header[5] == (AEGIS_FORMAT_VERSION if aegis else FORMAT_VERSION)
    assert header_size(header[:6]) == len(header) and payload_length(header) == len(data)
    for reader in (codec(tmp_path / "keys", seal=False), codec(tmp_path / "keys", aegis=True)):
        landing = bytearray(sent)
        out = memoryview(bytearray(len(data))) if where == "out" else None
        opened = reader.open(name, header, landing, in_place=where == "in_place", out=out)
        assert bytes(opened) == data


async def test_aegis_is_the_cfrg_drafts_aegis_128l() -> None:
    """The draft's test vector 2 (draft-irtf-cfrg-aegis-aead): a 16-byte message, no
    associated data, the 256-bit tag; and a flipped tag bit does not open."""
    key = bytes.fromhex("10010000000000000000000000000000")
    nonce = bytes.fromhex("10000200000000000000000000000000")
    ciphertext, tag = bytearray(16), bytearray(aegis_128l.TAG_SIZE)
    aegis_128l.seal_into(key, nonce, b"", bytes(16), out=ciphertext, tag=tag)
    assert ciphertext.hex() == "c1c0e58bd913006feba00f4b3cc3594e"
    assert tag.hex() == "25835bfbb21632176cf03840687cb968cace4617af1bd0f7d064c639a5c79ee4"
    # the same as a tag alone: the message's 16 zero bytes as associated data, where
    # encrypting them went before (draft test vector 1's shape)
    alone = bytearray(aegis_128l.TAG_SIZE)
    aegis_128l.tag_into(key, nonce, bytes(16), tag=alone)
    assert aegis_128l.tag_matches(key, nonce, bytes(16), bytes(alone)) and alone != tag
    assert not aegis_128l.tag_matches(key, nonce, bytes(15) + b"\1", bytes(alone))
    opened = bytearray(16)
    assert aegis_128l.open_into(key, nonce, b"", ciphertext, bytes(tag), out=opened)
    assert opened == bytes(16)
    tag[31] ^= 1
    assert not aegis_128l.open_into(key, nonce, b"", ciphertext, bytes(tag), out=opened)


@FORMATS
async def test_only_a_sealed_format_3_object_opens_in_one_read(
    tmp_path: Path, seal: bool, aegis: bool
) -> None:
    """The peer tier opens such an object straight from a NIXL landing, which the peer can
    write meanwhile: AEGIS checks the plaintext it writes. Others are copied out first."""
    write_key(tmp_path / "keys", 1, KEY_1)
    writer = codec(tmp_path / "keys", seal=seal, aegis=aegis)
    with writer.encode(chunk(0), payload(100)) as (header, _):
        assert opens_in_one_read(header) is (seal and aegis)
    assert not opens_in_one_read(header[:6])
