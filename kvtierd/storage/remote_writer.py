"""The remote tier's synchronous half: writes (on worker threads) and header listings.

A write stages every part with ``staging_ttl_s`` (pipelined, one node: the parts share a hash
tag), then commits with ``COMMIT_SCRIPT``, which sets the header only if every part still
exists and no header does. The synchronous client is used here because it writes large
values several times faster than the asyncio one (module docstring of ``remote_cluster``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import redis
import xxhash

from kvtierd.errors import (
    AlreadyExistsError,
    CorruptObjectError,
    StorageFullError,
    UnavailableError,
)
from kvtierd.storage.remote_cluster import UNREACHABLE, ClusterHealth
from kvtierd.storage.remote_format import (
    COMMIT_SCRIPT,
    ObjectHeader,
    RemoteOptions,
    as_bytes,
    header_pattern,
    new_generation,
    object_keys,
    part_count,
)
from kvtierd.types import ObjectMeta

if TYPE_CHECKING:
    import redis.cluster as sync_cluster

logger = logging.getLogger(__name__)

_SCAN_BATCH = 512


class ObjectWriter:
    """Writes objects and lists headers through the synchronous cluster client.

    Raises domain errors only: ``AlreadyExistsError``, ``StorageFullError`` (Redis
    ``maxmemory``), ``UnavailableError`` (unreachable, refused, or cancelled by a timeout).
    """

    def __init__(
        self,
        name: str,
        client: sync_cluster.RedisCluster,
        opts: RemoteOptions,
        health: ClusterHealth,
    ) -> None:
        self.name = name
        self.client = client
        self.opts = opts
        self.health = health

    def write(self, meta: ObjectMeta, view: memoryview, cancelled: threading.Event) -> ObjectMeta:
        """Checksum, stage parts, commit; returns ``meta`` with its xxh3_64 ``checksum``."""
        checksum = xxhash.xxh3_64_intdigest(view)
        if meta.checksum and meta.checksum != checksum:
            raise CorruptObjectError(f"{meta.key!r}: data does not match meta.checksum")
        keys = object_keys(self.opts.namespace, meta.tenant, meta.key)
        part_bytes = self.opts.value_bytes
        header = ObjectHeader(
            meta.replace(checksum=checksum),
            part_bytes,
            part_count(meta.size_bytes, part_bytes),
            new_generation(),
        )
        part_keys = keys.parts(header.generation, header.parts)
        try:
            if self.client.exists(keys.header):  # before moving any bytes
                raise AlreadyExistsError(f"remote tier {self.name}: {meta.key!r} exists")
            self._stage_parts(part_keys, view)
            if cancelled.is_set():
                raise UnavailableError(f"remote tier {self.name}: put {meta.key!r} timed out")
            ttl_ms = int(self.opts.ttl_s * 1000)
            status = self.client.eval(
                COMMIT_SCRIPT, 1 + len(part_keys), keys.header, *part_keys,
                header.encode(), ttl_ms,
            )  # fmt: skip
        except redis.exceptions.OutOfMemoryError as e:
            raise StorageFullError(f"remote tier {self.name}: Redis maxmemory reached") from e
        except UNREACHABLE as e:
            self.health.failed("put", e)
            raise UnavailableError(f"remote tier {self.name}: put {meta.key!r}: {e}") from e
        except redis.exceptions.RedisError as e:
            raise UnavailableError(f"remote tier {self.name}: Redis refused put: {e}") from e
        if status == 0:
            raise AlreadyExistsError(f"remote tier {self.name}: {meta.key!r} exists")
        if status != 1:
            raise UnavailableError(
                f"remote tier {self.name}: a staged part of {meta.key!r} expired before commit "
                f"(staging_ttl_s={self.opts.staging_ttl_s})"
            )
        return header.meta

    def _stage_parts(self, part_keys: list[str], view: memoryview) -> None:
        """SET every part with the staging TTL, pipelined in batches of ``pipeline_bytes``."""
        part_bytes = self.opts.value_bytes
        staging_ms = int(self.opts.staging_ttl_s * 1000)
        pipe = self.client.pipeline(transaction=False)  # type: ignore[no-untyped-call]
        batched = 0
        for i, name in enumerate(part_keys):
            part = view[i * part_bytes : (i + 1) * part_bytes]
            pipe.set(name, part, px=staging_ms)
            batched += len(part)
            if batched >= self.opts.pipeline_bytes:
                pipe.execute()  # execute() also empties the pipeline for the next batch
                batched = 0
        if batched:
            pipe.execute()

    def header(self, name: str) -> bytes | None:
        """GET one header (raw); redis errors propagate to the caller, which maps them."""
        return as_bytes(self.client.get(name))

    def metas(self) -> Iterator[ObjectMeta]:
        """SCAN every primary for the namespace's headers and GET them in pipelined batches.
        Unreadable headers are skipped (a reader of that key deletes them)."""
        batch: list[str] = []
        for name in self.client.scan_iter(match=header_pattern(self.opts.namespace), count=1000):
            batch.append(name.decode() if isinstance(name, bytes) else str(name))
            if len(batch) >= _SCAN_BATCH:
                yield from self._metas_of(batch)
                batch = []
        yield from self._metas_of(batch)

    def _metas_of(self, names: list[str]) -> Iterator[ObjectMeta]:
        if not names:
            return
        pipe = self.client.pipeline(transaction=False)  # type: ignore[no-untyped-call]
        for name in names:
            pipe.get(name)
        for name, raw in zip(names, pipe.execute(), strict=True):
            if raw is None:  # expired or deleted since the SCAN saw it
                continue
            try:
                yield ObjectHeader.decode(raw).meta
            except CorruptObjectError as e:  # named, so an operator sees which field
                logger.warning("remote tier %s: header %s skipped: %s", self.name, name, e)
