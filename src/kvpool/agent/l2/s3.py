"""S3 tier (or any S3-compatible store), shared by every agent of a pool.

Object key: ``<prefix>/<pool>/<tenant>/<2 hex>/<key hex>`` (see
:mod:`~kvpool.agent.l2.layout`): each tenant under its own prefix, and the 2-hex
shard spreads requests over 256 prefixes per tenant (S3 limits request rates
per prefix). The body is the codec's header and body (sealed or authenticated
under the pool's key). An object that does not open as its chunk is a miss and
is left alone: the bucket is shared, and another agent may already seal with a
key this one has not read yet; the chunk's next write-back replaces it.
Server-side encryption, where configured, is asked for on every put.

Large objects move in parallel: a put from ``multipart_threshold`` bytes is a
managed multipart upload (``part_size`` parts). A get asks for the first
``multipart_threshold`` bytes, which is the whole object for every smaller one
(one request, no HEAD), and fetches the rest of a larger one in parallel ranges.

Requests time out, retry with exponential backoff and jitter (botocore's
"standard" mode) and go through a :class:`CircuitBreaker`, so a dead S3 costs
the cache immediate misses. Blocking boto3 calls run on the adapter's own
threads, at most ``max_concurrency`` at once; nothing raises for a backend
failure: those are per-key ``None``/``False``, counted.

``listener`` (the agent's events, tier ``s3``) hears of each object this agent put
(``stored``) and of each one it deleted (``removed``, cause ``deleted``: a delete, or a
tenant's drop, page by page). The adapter keeps no list of what the bucket holds: objects
other agents wrote, and objects that go by other means (a lifecycle rule, another agent's
delete), are never told here.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypedDict, TypeVar, TypeVarTuple

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from botocore.response import StreamingBody

from kvpool.agent.core.cache_types import ChunkListener
from kvpool.agent.l2 import buffers, layout
from kvpool.agent.l2.base import AdapterStats, L2Object, ObjectKey, TierUnavailable
from kvpool.agent.l2.breaker import CircuitBreaker
from kvpool.agent.l2.codec import HEADER, IntegrityError, ObjectCodec
from kvpool.common.config import S3TierConfig
from kvpool.common.problems import ConfigError, show

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.literals import ServerSideEncryptionType
    from mypy_boto3_s3.type_defs import GetObjectOutputTypeDef

log = logging.getLogger(__name__)

BACKEND_ERRORS = (BotoCoreError, ClientError)
_MISSING = frozenset({"NoSuchKey", "404", "NotFound"})
_BATCH = 1000
"""Keys per list_objects_v2 page and per delete_objects request (both S3's maximum)."""
_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")


class _ServerSideEncryption(TypedDict, total=False):
    ServerSideEncryption: ServerSideEncryptionType
    SSEKMSKeyId: str


class _Refused(Exception):
    """The breaker is open: the call did not go out."""


class S3Adapter:
    name = "s3"

    def __init__(self, config: S3TierConfig, pool: str, codec: ObjectCodec) -> None:
        self.config = config
        self.codec = codec
        self.stats = AdapterStats()
        self.failures = 0
        """Gets, exists and deletes that failed at the backend (puts: ``stats.put_failures``)."""
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_reset_seconds)
        self.listener: ChunkListener | None = None
        """Told of objects put and deleted (the agent's events); set before the first put."""
        self._prefix = "/".join(part for part in (config.prefix.strip("/"), pool) if part)
        self._threshold = int(config.multipart_threshold)
        self._part_size = int(config.part_size)
        self._transfer = TransferConfig(
            multipart_threshold=self._threshold,
            multipart_chunksize=self._part_size,
            max_concurrency=config.max_concurrency,
        )
        self._client = _client(config)
        self._encryption_args: _ServerSideEncryption = {}
        """Server-side encryption arguments of every put."""
        if config.server_side_encryption is not None:
            self._encryption_args["ServerSideEncryption"] = config.server_side_encryption
        if config.sse_kms_key_id is not None:
            self._encryption_args["SSEKMSKeyId"] = config.sse_kms_key_id
        # Requests wait for a slot here rather than in the executor's queue, so that the
        # breaker is asked when a request can go out, not when it was queued.
        self._slots = asyncio.Semaphore(config.max_concurrency)
        self._executor = ThreadPoolExecutor(
            config.max_concurrency, thread_name_prefix=f"kvpool-s3-{pool}"
        )
        # Ranges of one large get, fetched from inside an _executor thread (a pool of
        # their own, so they never wait behind the gets that wait for them).
        self._parts = ThreadPoolExecutor(
            config.max_concurrency, thread_name_prefix=f"kvpool-s3-parts-{pool}"
        )

    def object_key(self, name: ObjectKey) -> str:
        return f"{self._prefix}/{layout.relative_path(name)}"

    async def put(self, objects: Sequence[L2Object]) -> list[bool]:
        return list(await asyncio.gather(*(self._put_one(obj) for obj in objects)))

    async def get(self, keys: Sequence[ObjectKey]) -> list[bytes | memoryview | None]:
        return list(await asyncio.gather(*(self._get_one(name) for name in keys)))

    async def exists(self, keys: Sequence[ObjectKey]) -> list[bool]:
        return list(await asyncio.gather(*(self._exists_one(name) for name in keys)))

    async def delete(self, keys: Sequence[ObjectKey]) -> list[bool]:
        return list(await asyncio.gather(*(self._delete_one(name) for name in keys)))

    async def enforce_quota(self, tenant: str) -> int:
        """S3 keeps no per-tenant accounting (it is shared by the pool): nothing to do."""
        return 0

    async def drop_tenant(self, tenant: str) -> int:
        """Delete every object under the tenant's prefix of the pool; returns how many.

        Cost: one list and one batch delete per 1000 objects, one after the other. Every
        agent of the pool may drop the same tenant at once: the objects go once, and a
        delete of an object already gone succeeds, so each reports what it saw.
        """
        if not layout.is_valid_tenant(tenant):
            return 0
        prefix = f"{self._prefix}/{layout.tenant_prefix(tenant)}"
        dropped = 0
        try:
            while keys := await self._call(self._list_blocking, prefix):
                await self._call(self._delete_many_blocking, keys)
                dropped += len(keys)
                if self.listener is not None:
                    self.listener.removed(tenant, _chunk_keys(keys), "deleted")
        except (_Refused, *BACKEND_ERRORS) as error:
            self.failures += 1
            raise TierUnavailable(
                f"S3 tier: dropping tenant {tenant} stopped after {dropped} objects: "
                f"{'the circuit breaker is open' if isinstance(error, _Refused) else error}"
            ) from error
        return dropped

    async def close(self) -> None:
        def shut_down() -> None:
            self._executor.shutdown()
            self._parts.shutdown()
            self._client.close()

        await asyncio.to_thread(shut_down)

    async def _put_one(self, obj: L2Object) -> bool:
        if not layout.is_valid(obj.name):
            self.stats.put_failures += 1
            return False
        try:
            await self._call(self._put_blocking, obj.name, obj.payload)
        except (_Refused, *BACKEND_ERRORS) as error:
            self.stats.put_failures += 1
            self._log_failure("put", obj.name, error)
            return False
        if self.listener is not None:
            self.listener.stored(obj.name.tenant, [obj.name.key])
        self.stats.puts += 1
        self.stats.put_bytes += len(obj.payload)
        return True

    async def _get_one(self, name: ObjectKey) -> bytes | memoryview | None:
        self.stats.gets += 1
        if not layout.is_valid(name):
            return None
        try:
            payload = await self._call(self._get_blocking, name)
        except (_Refused, *BACKEND_ERRORS) as error:
            self.failures += 1
            self._log_failure("get", name, error)
            return None
        except IntegrityError as error:
            self.stats.integrity_failures += 1
            log.warning("S3 tier: %s does not open (%s); a miss", self.object_key(name), error)
            return None
        if payload is not None:
            self.stats.hits += 1
            self.stats.get_bytes += len(payload)
        return payload

    async def _exists_one(self, name: ObjectKey) -> bool:
        if not layout.is_valid(name):
            return False
        try:
            return await self._call(self._exists_blocking, name)
        except (_Refused, *BACKEND_ERRORS) as error:
            self.failures += 1
            self._log_failure("exists", name, error)
            return False

    async def _delete_one(self, name: ObjectKey) -> bool:
        if not layout.is_valid(name):
            return True
        try:
            await self._call(self._delete_blocking, name)
        except (_Refused, *BACKEND_ERRORS) as error:
            self.failures += 1
            self._log_failure("delete", name, error)
            return False
        if self.listener is not None:
            self.listener.removed(name.tenant, [name.key], "deleted")
        return True

    async def _call(self, fn: Callable[[*_Ts], _T], *args: *_Ts) -> _T:
        """Run one blocking request in a thread, through the breaker.

        Raises :class:`_Refused` (breaker open), a backend error (counted by the
        breaker) or what ``fn`` raised otherwise (the backend answered).
        """
        async with self._slots:
            if not self.breaker.allow():
                raise _Refused
            try:
                result = await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
            except BACKEND_ERRORS:
                if self.breaker.failure():
                    log.warning(
                        "S3 tier: %d failures in a row; requests are misses for %.0f s",
                        self.breaker.failures,
                        self.breaker.reset_seconds,
                    )
                raise
            except IntegrityError:
                self.breaker.success()
                raise
            self.breaker.success()
            return result

    def _log_failure(self, operation: str, name: ObjectKey, error: Exception) -> None:
        if not isinstance(error, _Refused):
            log.debug("S3 tier: %s of %s failed: %s", operation, self.object_key(name), error)

    # The methods below run on the adapter's threads.

    def _put_blocking(self, name: ObjectKey, payload: bytes | memoryview) -> None:
        with self.codec.encode(name, payload) as (header, body):
            blob = header + body
        key = self.object_key(name)
        if len(blob) >= self._threshold:
            self._client.upload_fileobj(
                io.BytesIO(blob),
                self.config.bucket,
                key,
                ExtraArgs=dict(self._encryption_args),
                Config=self._transfer,
            )
        else:
            self._client.put_object(
                Bucket=self.config.bucket, Key=key, Body=blob, **self._encryption_args
            )

    def _get_blocking(self, name: ObjectKey) -> bytes | memoryview | None:
        """The verified payload, None if there is no such object; raises IntegrityError."""
        key = self.object_key(name)
        try:
            first = self._client.get_object(
                Bucket=self.config.bucket, Key=key, Range=f"bytes=0-{self._threshold - 1}"
            )
        except ClientError as error:
            code = error.response.get("Error", {}).get("Code", "")
            if code in _MISSING:
                return None
            if code == "InvalidRange":  # an empty object: not one of ours
                raise IntegrityError("empty object") from error
            raise
        total = _object_size(first)
        if total <= self._threshold:  # the whole object: its body straight into the result
            header = first["Body"].read(HEADER.size)
            body = buffers.fresh(max(0, total - HEADER.size))
            filled = _read_into(first["Body"], body)
            return self.codec.open(name, header, body[:filled], in_place=True)
        head = first["Body"].read()
        blob = buffers.fresh(total)
        blob[: len(head)] = head
        starts = range(len(head), total, self._part_size)
        ends = [min(start + self._part_size, total) for start in starts]
        parts = self._parts.map(self._get_range, itertools.repeat(key), starts, ends)
        for start, end, part in zip(starts, ends, parts, strict=True):
            if len(part) != end - start:
                raise IntegrityError("the object changed during a ranged read")
            blob[start:end] = part
        return self.codec.decode(name, blob, in_place=True)

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        response = self._client.get_object(
            Bucket=self.config.bucket, Key=key, Range=f"bytes={start}-{end - 1}"
        )
        return response["Body"].read()

    def _exists_blocking(self, name: ObjectKey) -> bool:
        try:
            self._client.head_object(Bucket=self.config.bucket, Key=self.object_key(name))
        except ClientError as error:
            if error.response.get("Error", {}).get("Code", "") in _MISSING:
                return False
            raise
        return True

    def _delete_blocking(self, name: ObjectKey) -> None:
        self._client.delete_object(Bucket=self.config.bucket, Key=self.object_key(name))

    def _list_blocking(self, prefix: str) -> list[str]:
        """Up to 1000 keys under ``prefix`` (the first page: the caller deletes what it got)."""
        page = self._client.list_objects_v2(
            Bucket=self.config.bucket, Prefix=prefix, MaxKeys=_BATCH
        )
        return [item["Key"] for item in page.get("Contents", [])]

    def _delete_many_blocking(self, keys: list[str]) -> None:
        answer = self._client.delete_objects(
            Bucket=self.config.bucket,
            Delete={"Objects": [{"Key": key} for key in keys], "Quiet": True},
        )
        errors = answer.get("Errors", [])
        if errors:
            first = errors[0]
            raise ClientError(
                {"Error": {"Code": first.get("Code", ""), "Message": first.get("Message", "")}},
                f"DeleteObjects ({len(errors)} of {len(keys)} keys failed)",
            )


def _chunk_keys(object_keys: list[str]) -> list[bytes]:
    """The chunk keys of a tenant's listed objects (their names' last part, in hex); a name
    the layout never gives is skipped."""
    found = []
    for object_key in object_keys:
        try:
            found.append(bytes.fromhex(object_key.rpartition("/")[2]))
        except ValueError:
            continue
    return found


def _read_into(stream: StreamingBody, view: memoryview) -> int:
    """Fill ``view`` from ``stream`` (the kernel writes the socket's bytes into it); how many
    bytes there were."""
    done = 0
    while done < len(view):
        got = stream.readinto(view[done:])  # type: ignore[arg-type]  # the stub says IO; a buffer it is
        if not got:
            break
        done += got
    return done


def _object_size(response: GetObjectOutputTypeDef) -> int:
    """The whole object's size, from a ranged get's Content-Range ("bytes 0-99/1234")."""
    content_range = response.get("ContentRange")
    if content_range:
        return int(content_range.rsplit("/", 1)[1])
    return response["ContentLength"]  # the server ignored the range and sent it all


def _client(config: S3TierConfig) -> S3Client:
    """boto3's client of ``config``; a :class:`ConfigError` naming ``s3.endpoint_url`` and
    ``s3.region`` where botocore refuses them (an endpoint or a region it cannot use)."""
    try:
        return boto3.session.Session().client(
            "s3",
            endpoint_url=config.endpoint_url,
            region_name=config.region,
            config=Config(
                connect_timeout=config.connect_timeout_seconds,
                read_timeout=config.read_timeout_seconds,
                retries={"max_attempts": config.max_attempts, "mode": "standard"},
                # Every object request may run its parts in parallel.
                max_pool_connections=config.max_concurrency**2,
                # The codec's tag already covers every object end to end; botocore's
                # CRC32 would be one more pass over every byte.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )
    except ValueError as error:  # botocore's InvalidRegionError too
        named = {"s3.endpoint_url": config.endpoint_url, "s3.region": config.region}
        where = ", ".join(f"{name}={show(value)}" for name, value in named.items() if value)
        raise ConfigError([f"{where or 's3'}: {error}"]) from None
