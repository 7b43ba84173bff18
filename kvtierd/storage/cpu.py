"""``cpu`` tier: objects live in the shared-memory arena, where co-located clients read and
write them in place.

The arena is larger than the tier's capacity by ``staging_bytes``: that space holds objects in
flight — a put between Allocate and Commit, an SSD object staged for a Get — which are not
objects of this tier until the engine *adopts* them. Blocks are reference-counted by the
engine (leases), so this tier only hands blocks out and takes them back.

Options: ``staging_bytes`` (default: capacity / 4, at least 256 MiB), ``arena_dir``
(default ``memfd``: an anonymous memory file nothing can leak; or a directory such as
``/dev/shm`` for a named file).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvtierd.config import TierConfig, parse_size
from kvtierd.errors import CapacityError, InvalidArgumentError
from kvtierd.storage.aligned_io import copy_bytes
from kvtierd.storage.allocator import Block, Move
from kvtierd.storage.arena import MEMFD, Arena
from kvtierd.storage.base import TransferFit
from kvtierd.storage.pooled import PooledTier
from kvtierd.types import ObjectMeta, TierStats

_CALIBRATION_BYTES = 64 << 20
"""Twice the last-level cache of the machines measured (32 MiB): a copy this large runs from
memory, as a reader's copy of an object that has sat in the arena does, not from cache."""
PUT_COMPACTION_SHARE = 64  # a put compacts the arena only to free 1/64 of it in one block
# A put leaves 1/64 of the arena free: with puts outrunning the moves down the arena stayed
# all but full, and every read into it (a client's load from the SSD tier, the profiler's)
# failed "arena full" (issue 42's bench_scale at 1M).
PUT_RESERVE_SHARE = 64


class CpuTier(PooledTier):
    kind = "cpu"
    # notes/machine-limits.md: the low end of a copy out of reused shared memory (8.3 GB/s).
    read_prior = TransferFit(0.0, 8.3e9)

    def __init__(self, config: TierConfig) -> None:
        super().__init__(config)
        default_staging = max(256 << 20, config.capacity_bytes // 4)
        self.staging_bytes = parse_size(
            config.options.get("staging_bytes", default_staging), f"tier {self.name} staging"
        )
        self.arena_dir = str(config.options.get("arena_dir", MEMFD))
        self._arena: Arena | None = None

    @property
    def arena(self) -> Arena:
        if self._arena is None:
            raise InvalidArgumentError(f"tier {self.name!r} is not started")
        return self._arena

    async def start(self) -> None:
        self._arena = Arena(self.capacity_bytes + self.staging_bytes, self.arena_dir)
        self._calibrate()

    def _calibrate(self, repeats: int = 5) -> None:
        """Time a reader's load — a copy out of the arena into ordinary process memory, in two
        halves on two threads as ``KVClient.get`` makes it — so the TTFT model has a figure
        before any traffic, and the only one it gets: readers copy in their own processes.
        The median of a few: one copy slowed by a neighbour's burst, or a lucky one (the best
        of three reported more than readers get), must not set it."""
        nbytes = min(_CALIBRATION_BYTES, self.arena.size_bytes // 2)
        if nbytes < self.read_meter.min_bytes:
            self.calibration_failed(
                f"the arena ({self.arena.size_bytes} bytes) is too small to time a copy of "
                f"{self.read_meter.min_bytes} bytes"
            )
            return
        block = self.arena.allocate(nbytes)
        try:
            src = self.arena.view(block)
            np.frombuffer(src, np.uint8).fill(1)
            dst = np.ones(nbytes, np.uint8).data  # touched (np.empty would time page faults)
            half = nbytes // 2
            seconds = []
            with ThreadPoolExecutor(1, thread_name_prefix="kvtierd-calibrate") as pool:
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    other = pool.submit(copy_bytes, dst[half:], src[half:])
                    copy_bytes(dst[:half], src[:half])
                    other.result()
                    seconds.append(time.perf_counter() - t0)
            self.read_meter.record(nbytes, statistics.median(seconds))
            self.write_meter.record(nbytes, statistics.median(seconds))
        finally:
            self.arena.free(block)

    async def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        self._index.clear()

    # -- blocks (the engine's data plane) ------------------------------------------------------

    def stage(self, nbytes: int) -> Block:
        """A block for bytes in flight (compacting a fragmented arena: ``PooledTier``);
        raises ``CapacityError`` when the arena is full."""
        return self._stage(nbytes, 0)

    def stage_put(self, nbytes: int, keep_reserve: bool = True) -> Block:
        """A block for a client's put: as :meth:`stage`, but refused where it would leave
        less than 1/:data:`PUT_RESERVE_SHARE` of the arena free (``keep_reserve``: the caller
        knows moves down are queued, which free room; without any, a put is what makes the
        placer move contexts down, and a CPU tier whose objects fill its capacity can fill the
        arena with their 4 KiB rounding: every put refused and nothing queued wedged issue
        42's bench_scale at 1M at 530k objects), and a fragmented arena is compacted
        only where that frees at least 1/:data:`PUT_COMPACTION_SHARE` of it in one block;
        otherwise the put is refused (``CapacityError``: RESOURCE_EXHAUSTED, retried by the
        client) until the daemon has moved contexts down. Puts outrunning the moves keep the
        arena all but full, and each compaction is a pass over every object in it: one a
        block of a few KiB was 47% of the daemon's CPU at 45k objects and held puts to 118 a
        second (issue 42's bench_scale at 1M); the daemon's own stages (moves, reads, its
        variants) still compact for what they need (issue 40.9)."""
        allocator = self.arena.allocator
        reserve = allocator.size_bytes // PUT_RESERVE_SHARE
        if keep_reserve and allocator.free_bytes - allocator.round_up(nbytes) < reserve:
            raise CapacityError(
                f"shared-memory arena full for puts: {allocator.free_bytes} bytes free, of "
                f"which {reserve} are kept for the daemon's reads (loads from slower tiers, "
                "profiling); retry once the daemon has moved contexts down"
            )
        return self._stage(nbytes, allocator.size_bytes // PUT_COMPACTION_SHARE)

    def _stage(self, nbytes: int, least_freed: int) -> Block:
        try:
            return self.allocate(self.arena.allocator, nbytes, least_freed)
        except CapacityError as e:
            raise CapacityError(f"shared-memory arena full: {e}") from e

    def _move_bytes(self, move: Move) -> None:
        self.arena.move(move)

    def view(self, block: Block, padded: bool = False) -> memoryview:
        return self.arena.view(block, padded)

    def free_block(self, block: Block) -> None:
        self.arena.free(block)

    def adopt(self, meta: ObjectMeta, block: Block) -> ObjectMeta:
        """Make a staged block an object of this tier, without copying."""
        if block.length != meta.size_bytes:
            raise InvalidArgumentError(
                f"block of {block.length} bytes for object {meta.key!r} of {meta.size_bytes}"
            )
        self._index.add(meta, block)
        return meta

    def detach(self, key: str) -> Block:
        """Forget the object but keep its block (the engine frees it once unleased)."""
        return self._index.pop(key).block

    def block_of(self, key: str) -> Block:
        return self._index.get(key).block

    # -- Tier interface --------------------------------------------------------------------------

    async def put(self, meta: ObjectMeta, data: memoryview) -> ObjectMeta:
        if len(data) != meta.size_bytes:
            raise InvalidArgumentError(
                f"object {meta.key!r}: {len(data)} bytes given, size_bytes says {meta.size_bytes}"
            )
        self._index.check_absent(meta.key)
        block = self.stage(meta.size_bytes)
        try:
            t0 = time.perf_counter()
            await asyncio.to_thread(copy_bytes, self.view(block), data)
            self.write_meter.record(meta.size_bytes, time.perf_counter() - t0)
            return self.adopt(meta, block)  # raises if a racing put of the key adopted first
        except BaseException:
            self.free_block(block)
            raise

    async def read_into(self, key: str, dst: memoryview, *, tenant: str = "") -> ObjectMeta:
        meta = self._index.get(key).meta
        with self.pinned(key) as block:
            t0 = time.perf_counter()
            await asyncio.to_thread(copy_bytes, dst[: meta.size_bytes], self.view(block))
        self.read_meter.record(meta.size_bytes, time.perf_counter() - t0)
        return meta

    async def delete(self, key: str, *, tenant: str = "") -> None:
        self.free_block(self.detach(key))

    def get_meta(self, key: str) -> ObjectMeta:
        return self._index.get(key).meta

    def metas(self) -> Iterator[ObjectMeta]:
        return self._index.metas()

    def used_bytes(self) -> int:
        return self._index.used_bytes

    def object_count(self) -> int:
        return len(self._index)

    def _detail(self) -> str:
        if self._arena is None:
            return "not started"
        notes = (f"arena {self._arena.path}", self.calibration_detail())
        return "; ".join(filter(None, notes))

    def stats(self) -> TierStats:
        base = super().stats()
        alloc = self.arena.allocator if self._arena else None
        return TierStats(
            name=base.name,
            capacity_bytes=base.capacity_bytes,
            used_bytes=base.used_bytes,
            object_count=base.object_count,
            read_bandwidth_bytes_per_s=base.read_bandwidth_bytes_per_s,
            write_bandwidth_bytes_per_s=base.write_bandwidth_bytes_per_s,
            fragmentation=alloc.fragmentation if alloc else 0.0,
            detail=self._detail(),
        )
