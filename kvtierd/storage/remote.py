"""The remote tier: objects in a shared Redis Cluster (or Valkey), EvicPress's unbounded tier.

An object is split into parts of at most ``value_bytes`` and described by a header key set
last (key scheme and scripts in :mod:`kvtierd.storage.remote_format`; docs/remote-tier.md).
Several daemons share one namespace: ``get_meta`` / ``contains`` / ``read_into`` ask Redis, not
a local cache. Reads never return unchecked bytes: the xxh3_64 of the whole object is verified
and a mismatch deletes the object. When a node cannot be reached reads are misses
(``NotFoundError``) and writes ``UnavailableError``, both within ``op_timeout_s``; the clients
refresh their slot map and reconnect by themselves when the node returns.

Key-taking methods accept ``tenant=`` (keyword, default ``""``): the tenant is part of the
hashed key, so one tenant cannot name another's object. ``put`` takes it from ``meta.tenant``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import redis

from kvtierd.errors import (
    CorruptObjectError,
    InvalidArgumentError,
    KvtierError,
    NotFoundError,
    StorageFullError,
    UnavailableError,
)
from kvtierd.storage.aligned_io import byte_view
from kvtierd.storage.base import Tier, Timer, TransferFit
from kvtierd.storage.remote_cluster import (
    UNREACHABLE,
    ClusterHealth,
    make_async_client,
    make_sync_client,
)
from kvtierd.storage.remote_format import ObjectHeader, RemoteOptions, new_generation, object_keys
from kvtierd.storage.remote_reader import ObjectReader
from kvtierd.storage.remote_writer import ObjectWriter
from kvtierd.storage.ssd_format import duplicate_positions
from kvtierd.types import ObjectMeta, TierStats

if TYPE_CHECKING:
    import redis.asyncio.cluster as aio_cluster
    import redis.cluster as sync_cluster

    from kvtierd.config import TierConfig

logger = logging.getLogger(__name__)

CALIBRATION_BYTES = 2 << 20  # above TransferMeter.min_bytes, small enough for every start


class RemoteTier(Tier):
    """Redis Cluster tier. ``capacity_bytes == 0`` means unbounded (see :attr:`unbounded`)."""

    kind = "remote"
    # benchmarks/RESULTS.md (remote tier): tier gets of 64 MiB ran 0.48-0.98 GB/s on loopback;
    # a real network is slower, and a load costs round trips (header, then the parts).
    read_prior = TransferFit(1e-3, 0.4e9)
    shared = True  # several daemons store into one cluster (the engine asks it on a miss)
    persistent = True  # objects live in Redis and outlive the daemon (not a Redis restart
    # without persistence: that is the operator's choice of save/appendonly)

    def __init__(self, config: TierConfig) -> None:
        super().__init__(config)
        self.options = RemoteOptions.from_mapping(config.options)
        self.lookup_budget_s = self.options.lookup_budget_s
        self._health = ClusterHealth()
        self._sync: sync_cluster.RedisCluster | None = None
        self._aio: aio_cluster.RedisCluster | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._probe_task: asyncio.Task[None] | None = None
        self._objects_w: ObjectWriter | None = None
        self._objects_r: ObjectReader | None = None
        # Local estimate of what the namespace holds: (tenant, key) -> bytes. Seeded by a SCAN
        # at start, then updated by this daemon's puts, deletes, reads and misses.
        self._sizes: dict[tuple[str, str], int] = {}
        self._sizes_lock = threading.Lock()
        self._used_bytes = 0

    @property
    def unbounded(self) -> bool:
        """True when the config gave ``capacity_bytes: 0`` (the placer's ``None``)."""
        return self.capacity_bytes == 0

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect both clients, seed the size estimate, calibrate, start the health probe.

        Raises ``UnavailableError`` when no startup node answers within the timeouts.
        """
        loop = asyncio.get_running_loop()
        self._pool = ThreadPoolExecutor(self.options.write_threads, f"kvtierd-{self.name}")
        try:
            self._sync = await loop.run_in_executor(self._pool, make_sync_client, self.options)
            self._aio = make_async_client(self.options)
            await asyncio.wait_for(self._aio.initialize(), self.options.op_timeout_s)
            self._objects_w = ObjectWriter(self.name, self._sync, self.options, self._health)
            self._objects_r = ObjectReader(self.name, self._aio, self.options)
            if self.options.scan_on_start:
                await loop.run_in_executor(self._pool, self._seed_sizes)
            await self._calibrate()
        except UNREACHABLE as e:
            await self.close()
            nodes = ", ".join(f"{h}:{p}" for h, p in self.options.nodes)
            raise UnavailableError(f"remote tier {self.name}: cluster {nodes} unreachable") from e
        except BaseException:
            await self.close()  # never leave clients or threads behind a failed start
            raise
        self._probe_task = asyncio.create_task(self._probe_loop(), name=f"{self.name}-probe")
        self._probe_task.add_done_callback(self._probe_ended)

    async def close(self) -> None:
        """Stop the probe, close both clients, wait for in-flight writes (each bounded by the
        socket timeouts; cut writes leave only expiring staged parts). Idempotent. Every wait
        is bounded by ``op_timeout_s``: a client that does not close in time raises
        ``TimeoutError`` after everything else is released."""
        probe, self._probe_task = self._probe_task, None
        if probe is not None:
            probe.cancel()
            # asyncio.wait, not gather: a probe stuck in a client call must not hold close()
            await asyncio.wait({probe}, timeout=self.options.op_timeout_s)
        aio, pool, sync = self._aio, self._pool, self._sync
        self._aio, self._pool, self._sync = None, None, None
        self._objects_r, self._objects_w = None, None
        try:
            if aio is not None:
                await asyncio.wait_for(aio.aclose(), self.options.op_timeout_s)
        finally:
            if pool is not None:  # joined off the event loop: writers may still be sending
                await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True)
            if sync is not None:
                sync.close()

    async def _calibrate(self) -> None:
        """One put + read + delete of ``CALIBRATION_BYTES`` to seed both bandwidth meters. A
        cluster that answers but refuses the probe (full, read-only replica, ACL) does not stop
        the start: the load model uses :attr:`read_prior` until real reads are timed."""
        data = memoryview(bytearray(CALIBRATION_BYTES))
        meta = ObjectMeta(key=f"calibrate/{new_generation()}", size_bytes=len(data))
        try:
            meta = await self.put(meta, data)
            await self.read_into(meta.key, data)
            await self.delete(meta.key)
        except (KvtierError, redis.RedisError) as e:
            if isinstance(e, (UnavailableError, *UNREACHABLE)):
                raise  # the cluster itself cannot be reached: start fails, as it says
            self.calibration_failed(f"the probe object was refused: {type(e).__name__}: {e}")

    async def _probe_loop(self) -> None:
        while True:  # runs until close() cancels it
            await asyncio.sleep(self.options.health_interval_s)
            if self._aio is not None:
                await self._health.probe(self._aio, self.options.connect_timeout_s + 0.5)

    def _probe_ended(self, task: asyncio.Task[None]) -> None:
        error = None if task.cancelled() else task.exception()
        if error is not None:  # the probe only ends by close(): anything else is reported
            logger.error("remote tier %s: health probe died: %r", self.name, error)
            self._health.failed("health probe", error)

    @property
    def _writer(self) -> ObjectWriter:
        if self._objects_w is None:
            raise UnavailableError(f"remote tier {self.name} is not started")
        return self._objects_w

    @property
    def _reader(self) -> ObjectReader:
        if self._objects_r is None:
            raise UnavailableError(f"remote tier {self.name} is not started")
        return self._objects_r

    # -- writes ------------------------------------------------------------------------------

    async def put(self, meta: ObjectMeta, data: memoryview) -> ObjectMeta:
        """Store the object: parts (with a staging TTL) pipelined, then the header atomically.

        Raises ``AlreadyExistsError``, ``StorageFullError`` (capacity or Redis ``maxmemory``),
        ``UnavailableError`` (cluster unreachable, or ``op_timeout_s`` exceeded).
        """
        view = byte_view(data, "put data")
        if len(view) != meta.size_bytes:
            raise InvalidArgumentError(f"data is {len(view)} bytes, meta says {meta.size_bytes}")
        if not self.unbounded and self.used_bytes() + meta.size_bytes > self.capacity_bytes:
            raise StorageFullError(
                f"remote tier {self.name}: {meta.size_bytes} bytes do not fit "
                f"({self.used_bytes()} of {self.capacity_bytes} used)"
            )
        if self._pool is None:
            raise UnavailableError(f"remote tier {self.name} is not started")
        cancelled = threading.Event()
        job = asyncio.get_running_loop().run_in_executor(
            self._pool, self._writer.write, meta, view, cancelled
        )
        try:
            with Timer() as t:
                stored = await asyncio.wait_for(job, self.options.op_timeout_s)
        except TimeoutError as e:
            cancelled.set()  # the worker will not commit; its staged parts expire
            self._health.failed("put", e)
            raise UnavailableError(
                f"remote tier {self.name}: put {meta.key!r} exceeded {self.options.op_timeout_s}s"
            ) from e
        self.write_meter.record(stored.size_bytes, t.seconds)
        self._remember(stored)
        return stored

    async def delete(self, key: str, *, tenant: str = "") -> None:
        """Remove the object; raises ``NotFoundError`` if absent, ``UnavailableError`` when the
        cluster cannot be reached."""
        keys = object_keys(self.options.namespace, tenant, key)
        timeout_s = self.options.op_timeout_s
        try:
            raw = await asyncio.wait_for(self._reader.header(keys.header), timeout_s)
            dropped = raw is not None and await asyncio.wait_for(
                self._reader.drop(keys, raw), timeout_s
            )
        except UNREACHABLE as e:
            self._health.failed("delete", e)
            raise UnavailableError(f"remote tier {self.name}: delete {key!r}: {e}") from e
        self._forget(tenant, key)
        if not dropped:
            raise NotFoundError(f"remote tier {self.name}: no object {key!r}")

    async def relabel(self, meta: ObjectMeta) -> None:
        """Rewrite the object's header with ``meta``'s context identity (the base class's
        docstring), only if no other daemon changed it since it was read."""
        keys = object_keys(self.options.namespace, meta.tenant, meta.key)
        timeout_s = self.options.op_timeout_s
        try:
            raw = await asyncio.wait_for(self._reader.header(keys.header), timeout_s)
            if raw is None:
                raise NotFoundError(f"remote tier {self.name}: no object {meta.key!r}")
            old = ObjectHeader.decode(raw)
            new = dataclasses.replace(old, meta=old.meta.replace(
                context_id=meta.context_id, parent_context_id=meta.parent_context_id
            ))  # fmt: skip
            if new == old:
                return
            if not await asyncio.wait_for(self._reader.relabel(keys, raw, new.encode()), timeout_s):
                raise NotFoundError(
                    f"remote tier {self.name}: {meta.key!r} changed while it was relabelled"
                )
        except UNREACHABLE as e:
            self._health.failed("relabel", e)
            raise UnavailableError(f"remote tier {self.name}: relabel {meta.key!r}: {e}") from e

    # -- reads -------------------------------------------------------------------------------

    async def read_into(self, key: str, dst: memoryview, *, tenant: str = "") -> ObjectMeta:
        """Copy the object into ``dst`` after checking its xxh3_64.

        Raises ``NotFoundError`` when absent, incomplete or the cluster unreachable (a miss),
        ``CorruptObjectError`` on a checksum mismatch (the object is then deleted).
        """
        keys = object_keys(self.options.namespace, tenant, key)
        out = byte_view(dst, "read destination")
        if out.readonly:
            raise InvalidArgumentError("read_into needs a writable destination")
        try:
            with Timer() as t:
                meta = await asyncio.wait_for(
                    self._reader.read(keys, key, tenant, out), self.options.op_timeout_s
                )
        except (NotFoundError, CorruptObjectError):
            self._forget(tenant, key)
            raise
        except UNREACHABLE as e:
            self._health.failed("read", e)
            raise NotFoundError(
                f"remote tier {self.name}: {key!r} is a miss: cluster unreachable ({e!r})"
            ) from e
        except redis.exceptions.RedisError as e:
            raise UnavailableError(f"remote tier {self.name}: Redis refused read: {e}") from e
        self.read_meter.record(meta.size_bytes, t.seconds)
        self._remember(meta)
        return meta

    # -- index -------------------------------------------------------------------------------

    def get_meta(self, key: str, *, tenant: str = "") -> ObjectMeta:
        """The object's metadata, read from Redis (one GET; blocks the caller for a round trip:
        async callers should prefer :meth:`fetch_meta`). Unreachable or unreadable -> miss."""
        keys = object_keys(self.options.namespace, tenant, key)
        try:
            raw = self._writer.header(keys.header)
        except UNREACHABLE as e:
            self._health.failed("get_meta", e)
            raise NotFoundError(f"remote tier {self.name}: {key!r} is a miss: {e!r}") from e
        return self._meta_from(raw, key, tenant)

    async def fetch_meta(self, key: str, *, tenant: str = "") -> ObjectMeta:
        """``get_meta`` without blocking the event loop (bounded by ``op_timeout_s``)."""
        keys = object_keys(self.options.namespace, tenant, key)
        try:
            raw = await asyncio.wait_for(
                self._reader.header(keys.header), self.options.op_timeout_s
            )
        except UNREACHABLE as e:
            self._health.failed("get_meta", e)
            raise NotFoundError(f"remote tier {self.name}: {key!r} is a miss: {e!r}") from e
        return self._meta_from(raw, key, tenant)

    def _meta_from(self, raw: bytes | None, key: str, tenant: str) -> ObjectMeta:
        if raw is None:
            self._forget(tenant, key)
            raise NotFoundError(f"remote tier {self.name}: no object {key!r}")
        try:
            meta = ObjectHeader.decode(raw).meta
        except CorruptObjectError as e:  # the next read_into or delete removes it
            raise NotFoundError(f"remote tier {self.name}: {key!r} is unreadable") from e
        if meta.key != key or meta.tenant != tenant:
            raise NotFoundError(f"remote tier {self.name}: no object {key!r}")
        self._remember(meta)
        return meta

    def contains(self, key: str, *, tenant: str = "") -> bool:
        try:
            self.get_meta(key, tenant=tenant)
        except NotFoundError:
            return False
        return True

    def metas(self) -> Iterator[ObjectMeta]:
        """Every object of the namespace, all tenants: SCAN of every primary for headers plus
        pipelined GETs — O(keys in the cluster) server work; for start-up and audits only.
        Raises ``UnavailableError`` if a node is unreachable (the listing is then partial)."""
        try:
            found = list(self._writer.metas())
        except UNREACHABLE as e:
            self._health.failed("scan", e)
            raise UnavailableError(f"remote tier {self.name}: scan failed: {e}") from e
        # Two headers of one context at one position: neither is listed (ssd_format); they
        # stay in the shared store, whose objects this daemon does not delete unread.
        refused = duplicate_positions(found)
        for meta in found:
            if meta.key in refused:
                logger.warning("remote tier %s: %r refused: %s", self.name, meta.key,
                               refused[meta.key])  # fmt: skip
            else:
                yield meta

    def _seed_sizes(self) -> None:
        # every readable header, refused positions too: their bytes are in the store
        for meta in self._writer.metas():
            self._remember(meta)

    def _remember(self, meta: ObjectMeta) -> None:
        with self._sizes_lock:
            old = self._sizes.get((meta.tenant, meta.key), 0)
            self._sizes[(meta.tenant, meta.key)] = meta.size_bytes
            self._used_bytes += meta.size_bytes - old

    def _forget(self, tenant: str, key: str) -> None:
        with self._sizes_lock:
            self._used_bytes -= self._sizes.pop((tenant, key), 0)

    def used_bytes(self) -> int:
        """Local estimate: objects seen at start (SCAN) and since by this daemon. Objects other
        daemons write unseen, or that expire by TTL unseen, are missed (docs/remote-tier.md)."""
        with self._sizes_lock:
            return self._used_bytes

    def object_count(self) -> int:
        """Local estimate, like :meth:`used_bytes` (``len(list(metas()))`` is the exact count)."""
        with self._sizes_lock:
            return len(self._sizes)

    @property
    def healthy(self) -> bool:
        return self._health.view.healthy

    def stats(self) -> TierStats:
        health = self._health.view
        capacity = "unbounded" if self.unbounded else f"{self.capacity_bytes} bytes"
        nodes = ",".join(f"{h}:{p}" for h, p in self.options.nodes)
        detail = f"redis cluster {nodes} namespace={self.options.namespace} capacity={capacity}"
        if health.detail:
            detail += f"; {health.detail}"
        if self.calibration_detail():
            detail += f"; {self.calibration_detail()}"
        return TierStats(
            name=self.name,
            capacity_bytes=self.capacity_bytes,
            used_bytes=self.used_bytes(),
            object_count=self.object_count(),
            read_bandwidth_bytes_per_s=self.read_meter.bytes_per_s,
            write_bandwidth_bytes_per_s=self.write_meter.bytes_per_s,
            healthy=health.healthy,
            detail=detail,
        )
