# Long because it is one tier's whole contract (put, get, move, scan, recovery) on one index.
"""The SSD tier: one self-describing file per object (DESIGN.md §3.5), aligned parallel I/O.

Files and format: :mod:`kvtierd.storage.ssd_files` and :mod:`kvtierd.storage.ssd_format`.
A put writes a temp file (O_DIRECT where the filesystem allows), fsyncs it, renames it into
place and fsyncs the directory, so an object is either wholly visible or absent, also after a
SIGKILL or power loss. ``start()`` rebuilds the index from the file headers alone. Every read
verifies the data checksum (xxh3_64) and the header; a file that fails is moved to
``quarantine/``, counted in :attr:`SsdTier.quarantined_count`, forgotten and never served.

Bytes move in ``part_bytes`` pieces, ``queue_depth`` of them in flight, with ``os.preadv`` /
``os.pwritev`` on the tier's own thread pool — never on the event loop. Not aiofiles (DESIGN.md
§3.10): it runs the same blocking calls on the loop's shared default executor, only through a
seek + read file object (one call in flight per handle), and was no faster in
``benchmarks/micro/bench_ssd.py`` (figures in benchmarks/RESULTS.md).

Keys are unique within the tier whatever the tenant (the engine namespaces them); the file name
is xxh3_128 of ``(tenant, key)``, so no client string reaches a path. Zero-byte objects are
allowed (a header-only file).

Options (``TierConfig.options``):

``o_direct``: ``"auto"`` (default) | ``true`` | ``false``
    ``auto`` uses O_DIRECT when the filesystem accepts it (probed at start, and any put that
    gets EINVAL switches the tier to buffered I/O); ``true`` makes start fail when it does not.
``queue_depth``: int, default 4
    I/O threads = parts in flight across all transfers (1..64).
``part_bytes``: size, default 4 MiB
    Piece size of a transfer, a multiple of 4096 bytes; also the size of each bounce buffer.
    ``chunk_bytes``, its name before issue 17, is accepted for one release with a warning.
``fsync``: bool, default true
    fsync each object and its directory at put. ``false`` trades crash durability for speed.
``index_checkpoint_s``: seconds, default 300
    How often the index checkpoint (``ssd_checkpoint``) is written while objects change; it is
    always written at stop. ``0``: at stop only.

:meth:`SsdTier.put_many` writes many small objects with one filesystem sync for the whole batch
(``ssd_batch``; the shutdown flush uses it): same files, same guarantees once it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import logging
import os
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from kvtierd.errors import (
    AlreadyExistsError,
    CorruptObjectError,
    InvalidArgumentError,
    NotFoundError,
    StorageFullError,
)
from kvtierd.heap import trim
from kvtierd.storage.aligned_io import ALIGN, BouncePool, byte_view, open_file
from kvtierd.storage.base import Tier, Timer, TransferFit
from kvtierd.storage.ssd_batch import BatchItem, commit_batch, discard, write_temps
from kvtierd.storage.ssd_checkpoint import (
    SAMPLE,
    Checkpoint,
    disagreeing,
    load_checkpoint,
    scan_with_checkpoint,
    stamp_dirs,
    stamp_files,
    write_checkpoint,
)
from kvtierd.storage.ssd_files import (
    BadFile,
    Layout,
    StoredFile,
    commit_file,
    quarantine_file,
    remove_quietly,
    rewrite_header,
    scan_subdir,
)
from kvtierd.storage.ssd_format import (
    DataHasher,
    data_checksum,
    duplicate_positions,
    encode_header,
)
from kvtierd.storage.ssd_options import SsdOptions
from kvtierd.storage.ssd_probe import calibrate, probe_o_direct
from kvtierd.storage.ssd_runner import IoRunner
from kvtierd.storage.ssd_transfer import plan_parts, read_header, read_part, write_part
from kvtierd.storage.ssd_transfer import write_header as _write_header
from kvtierd.types import ObjectMeta, TierStats

if TYPE_CHECKING:
    from kvtierd.config import TierConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class SsdTier(Tier):
    """Objects as files under ``config.path``; see the module docstring for options."""

    kind: ClassVar[str] = "ssd"
    persistent: ClassVar[bool] = True
    # notes/machine-limits.md: the slowest read measured on the reference disk (buffered, cold:
    # 0.55 GB/s) and the p50 of a 1 MiB random O_DIRECT read at QD1 (0.54 ms) as the overhead.
    read_prior: ClassVar[TransferFit] = TransferFit(0.54e-3, 0.55e9)

    def __init__(self, config: TierConfig) -> None:
        super().__init__(config)
        if not config.path:
            raise InvalidArgumentError(f"ssd tier {config.name!r} needs a path")
        self.options = SsdOptions.from_mapping(config.options, config.name)
        self.layout = Layout(Path(config.path))
        self.direct = False
        self.quarantined_count = 0
        self.calibrated = False
        # key -> the object's metadata, and its header length where it is not one page (a
        # StoredFile an object was 48 bytes of the index more at 1M objects, issue 42).
        self._index: dict[str, ObjectMeta] = {}
        self._long_headers: dict[str, int] = {}
        self._used_bytes = 0
        self._writing: set[str] = set()
        self._removing: dict[str, asyncio.Event] = {}
        self._io = IoRunner(config.name, self.options.queue_depth)
        self._bounce: BouncePool | None = None
        self.index_source = ""  # how start found the index (checkpoint or header scan, why)
        self._changes = self._saved_changes = 0  # index changes, and as of the last checkpoint
        self._checkpointer: asyncio.Task[None] | None = None
        self._scan_counts = (0, 0, 0)  # from the checkpoint, headers read, checkpoint rows gone

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Create dirs, drop uncommitted temp files, rebuild the index, calibrate bandwidth."""
        self._io.start()
        self._bounce = BouncePool(self.options.queue_depth, self.options.part_bytes)
        await self._io.run(self.layout.create)
        removed = await self._io.run(self.layout.remove_temp_files)
        self.direct = await self._io.run(probe_o_direct, self.layout, self.options.o_direct)
        await self._rebuild_index()
        self._saved_changes = self._changes
        if self.options.index_checkpoint_s > 0:
            self._checkpointer = asyncio.create_task(
                self._checkpoint_forever(), name=f"kvtierd-{self.name}-checkpoint"
            )
        failed = await calibrate(self, self.layout)
        self.calibrated = not failed
        if failed:
            self.calibration_failed(failed)
        logger.info(
            "ssd tier %s at %s: %d objects, %d bytes (%s), %d temp files removed, %d quarantined, "
            "o_direct=%s, calibrated=%s, read %.2f GB/s, write %.2f GB/s",
            self.name, self.layout.root, len(self._index), self._used_bytes, self.index_source,
            removed,
            self.quarantined_count, self.direct, self.calibrated, self.read_meter.bytes_per_s / 1e9,
            self.write_meter.bytes_per_s / 1e9,
        )  # fmt: skip

    async def close(self) -> None:
        """Stop the checkpoint loop, write the index checkpoint, refuse new operations, wait
        for in-flight ones, stop the I/O threads."""
        if self._checkpointer is not None:
            self._checkpointer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checkpointer
            self._checkpointer = None
        if self._bounce is not None:  # started
            try:
                await self.save_checkpoint()
            except OSError as e:
                logger.warning("ssd tier %s: index checkpoint not written: %s", self.name, e)
        await self._io.close()
        if self._bounce is not None:
            self._bounce.close()
            self._bounce = None

    async def _rebuild_index(self) -> None:
        """The index from the checkpoint where it agrees with the files, else (or for the
        files it does not know as they are) from their headers (``ssd_checkpoint``)."""
        started = time.perf_counter()
        ckpt, why = await self._io.run(load_checkpoint, self.layout)
        found, bad, reused = await self._scan(ckpt)
        del ckpt  # its columns: ~100 bytes an object, not kept past the scan
        if reused:
            step = max(1, len(reused) // SAMPLE)
            why = await self._io.run(disagreeing, reused[::step][:SAMPLE], self.layout)
            if why:
                why = f"disagrees with a file header: {why}"
                found, bad, _ = await self._scan(None)
        took = time.perf_counter() - started
        self.index_source = f"{self._describe_source(why)}, in {took:.2f} s"
        self._index.clear()
        self._long_headers.clear()
        self._used_bytes = 0
        # Two files of one context at one position: neither is trusted (ssd_format).
        refused = duplicate_positions(f.meta for f in found)
        for f in found:
            if f.meta.key in refused:
                path = self.layout.path_of(f)
                bad.append(BadFile(path, f"{path}: {refused[f.meta.key]}"))
        for b in bad:
            await self._io.run(quarantine_file, b.path, self.layout)
            self.quarantined_count += 1
            logger.warning("ssd tier %s: quarantined %s at start", self.name, b.reason)
        for f in found:
            if f.meta.key not in refused:
                self._remember(f)

    async def _scan(
        self, ckpt: Checkpoint | None
    ) -> tuple[list[StoredFile], list[BadFile], list[StoredFile]]:
        """Every object file, the bad ones, and those taken from the checkpoint ``ckpt``
        (``None``: every header is read)."""
        subdirs = self.layout.subdirs()
        if ckpt is None:
            scans = await asyncio.gather(
                *(self._io.run(scan_subdir, d, self.layout) for d in subdirs)
            )
            self._scan_counts = (0, sum(len(g) + len(b) for g, b in scans), 0)
            good = [f for g, _ in scans for f in g]
            return good, [b for _, bads in scans for b in bads], []
        # One thread: with the checkpoint a file costs a stat and a row's decoding, Python
        # work that threads only slow down on the GIL (100k files beside a busy core: 4.4-4.9 s
        # on the four I/O threads, 3.4-3.5 s on one).
        helped = await self._io.run(
            lambda: [scan_with_checkpoint(d, self.layout, ckpt) for d in subdirs]
        )
        reused = [f for h in helped for f in h.reused]
        seen = sum(h.seen for h in helped)
        self._scan_counts = (len(reused), sum(h.read for h in helped), ckpt.count - seen)
        return [f for h in helped for f in h.good], [b for h in helped for b in h.bad], reused

    def _describe_source(self, why: str) -> str:
        """How the index was found, for the start-up line (tests and operators read it)."""
        if why:
            return f"header scan of {self._scan_counts[1]} files (index checkpoint {why})"
        reused, read, gone = self._scan_counts
        return (f"index checkpoint: {reused} objects from it, {read} headers read "
                f"(files new or changed since it), {gone} of its files gone")  # fmt: skip

    async def save_checkpoint(self) -> None:
        """Write the index checkpoint now (at stop and every ``index_checkpoint_s``). Files
        being put, rewritten or removed meanwhile are left out: the next start reads their
        headers (a row is only kept where the index still holds the very entry stamped)."""
        changes = self._changes
        dirs = await self._io.run(stamp_dirs, self.layout)  # before the rows (ssd_checkpoint)
        # a copy of the index's values (8 bytes an object), not a StoredFile each: the I/O
        # thread pairs each with its header length as it stamps it
        metas, long_headers = list(self._index.values()), dict(self._long_headers)
        files = ((m, long_headers.get(m.key, ALIGN)) for m in metas)
        stamped = await self._io.run(stamp_files, files, self.layout)
        del metas, files
        index, writing = self._index, self._writing
        kept = stamped.select(
            [index.get(m.key) is m and m.key not in writing for m in stamped.metas]
        )
        job = functools.partial(write_checkpoint, self.layout, dirs, kept, self.options.fsync)
        with Timer() as t:
            nbytes = await self._io.run(job)
        count = len(kept)
        del stamped, kept, job
        # Its columns and the file's body were tens of MB at 1M objects, freed now into a heap
        # that is never trimmed otherwise (kvtierd/heap.py): each checkpoint while puts went on
        # left them resident (issue 42: ~500 bytes an object at 300k puts, one every 20 s).
        # On the I/O thread: a trim walks the heap's free pages, not the event loop's work.
        await self._io.run(trim, "an index checkpoint")
        self._saved_changes = changes
        logger.info("ssd tier %s: index checkpoint of %d objects written (%d bytes, %.2f s)",
                    self.name, count, nbytes, t.seconds)  # fmt: skip

    async def _checkpoint_forever(self) -> None:
        while True:
            await asyncio.sleep(self.options.index_checkpoint_s)
            if self._changes != self._saved_changes:
                try:
                    await self.save_checkpoint()
                except OSError as e:  # the start reads headers instead: slower, not wrong
                    logger.warning("ssd tier %s: index checkpoint not written: %s", self.name, e)

    # -- Tier interface -------------------------------------------------------------------

    async def put(self, meta: ObjectMeta, data: memoryview) -> ObjectMeta:
        view = byte_view(data, "put data")
        if view.nbytes != meta.size_bytes:
            raise InvalidArgumentError(
                f"put {meta.key!r}: size_bytes is {meta.size_bytes} but {view.nbytes} bytes given"
            )
        if meta.key in self._index or meta.key in self._writing:
            raise AlreadyExistsError(f"object {meta.key!r} already exists in tier {self.name}")
        self._writing.add(meta.key)  # claimed before any await: a second put sees it
        try:
            return await self._io.spawn(self._put(meta, view))
        finally:
            self._writing.discard(meta.key)

    async def put_many(self, items: list[tuple[ObjectMeta, memoryview]]) -> list[ObjectMeta]:
        """Put many (small) objects with one filesystem sync for all (``ssd_batch``): all are
        stored and durable when it returns, or none is (the error is raised)."""
        batch = [BatchItem(meta, byte_view(data, "put data")) for meta, data in items]
        keys = [b.meta.key for b in batch]
        for b in batch:
            if b.data.nbytes != b.meta.size_bytes:
                raise InvalidArgumentError(
                    f"put {b.meta.key!r}: size_bytes is {b.meta.size_bytes} but "
                    f"{b.data.nbytes} bytes given"
                )
        if len(set(keys)) != len(keys) or any(k in self._index or k in self._writing for k in keys):
            raise AlreadyExistsError(f"a batch of {len(keys)} objects names one that exists "
                                     f"in tier {self.name} (or names one twice)")  # fmt: skip
        self._writing.update(keys)  # claimed before any await, as put does
        try:
            for key in keys:
                pending = self._removing.get(key)
                if pending is not None:
                    await pending.wait()
            with Timer() as t:
                try:
                    stored = await self._io.spawn(self._write_batch(batch))
                except OSError as e:
                    if e.errno in _FULL_ERRNOS:
                        raise StorageFullError(f"tier {self.name}: no space for a batch of "
                                               f"{len(keys)} objects under {self.layout.root}: "
                                               f"{os.strerror(e.errno)}") from e  # fmt: skip
                    raise
        finally:
            self._writing.difference_update(keys)
        for f in stored:
            self._remember(f)
        self.write_meter.record(sum(f.meta.size_bytes for f in stored), t.seconds)
        return [f.meta for f in stored]

    async def _write_batch(self, batch: list[BatchItem]) -> list[StoredFile]:
        """``ssd_batch``'s steps: temp files written by every I/O thread, then one commit."""
        share = -(-len(batch) // self.options.queue_depth)
        calls: list[Callable[[], Any]] = [
            functools.partial(write_temps, batch[i : i + share], self.layout)
            for i in range(0, len(batch), share)
        ]
        results = await self._io.run_all(calls)
        temps = [t for r in results if not isinstance(r, Exception) for t in r]
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            await self._io.run(discard, temps)
            raise failed[0]
        return await self._io.run(commit_batch, temps, self.layout, self.options.fsync)

    async def read_into(self, key: str, dst: memoryview, *, tenant: str = "") -> ObjectMeta:
        view = byte_view(dst, "read destination")
        if view.readonly:
            raise InvalidArgumentError(f"read {key!r}: the destination buffer is read-only")
        return await self._io.spawn(self._read(key, view))

    async def delete(self, key: str, *, tenant: str = "") -> None:
        meta = self._index.get(key)
        if meta is None:
            raise NotFoundError(f"object {key!r} not found in tier {self.name}")
        self._forget(key)
        path = self.layout.object_path(meta.tenant, meta.key)
        await self._io.spawn(self._remove_file(key, self._io.run(_unlink_if_present, path)))

    async def relabel(self, meta: ObjectMeta) -> None:
        """Rewrite the object file's header with ``meta``'s context identity (the base
        class's docstring), atomically (``ssd_files.rewrite_header``). The engine calls it
        under the context's lock, so no delete of the object runs meanwhile; one by another
        path (quarantine) is undone: a file renamed back over a forgotten key is removed."""
        found = self._index.get(meta.key)
        if found is None:
            raise NotFoundError(f"object {meta.key!r} not found in tier {self.name}")
        entry = self._file(found)
        new = entry.meta.replace(
            context_id=meta.context_id, parent_context_id=meta.parent_context_id
        )
        if new == entry.meta:
            return
        header = encode_header(new)
        path = self.layout.path_of(entry)
        temp = self.layout.temp_path(path)
        job = functools.partial(
            rewrite_header, path, temp, header, entry.header_len, self.options.fsync
        )
        self._writing.add(meta.key)  # a put of the key waits for no rename: it is refused
        try:
            await self._io.spawn(self._io.run(job))
            if self._index.get(meta.key) is found:
                self._forget(meta.key)
                self._remember(StoredFile(new, len(header)))
            else:  # deleted or quarantined while the copy ran: the rename brought it back
                await self._io.run(_unlink_if_present, path)
        except FileNotFoundError as e:
            raise NotFoundError(f"object {meta.key!r} not found in tier {self.name}") from e
        finally:
            self._writing.discard(meta.key)

    def get_meta(self, key: str) -> ObjectMeta:
        meta = self._index.get(key)
        if meta is None:
            raise NotFoundError(f"object {key!r} not found in tier {self.name}")
        return meta

    def metas(self) -> Iterator[ObjectMeta]:
        return iter(list(self._index.values()))

    def used_bytes(self) -> int:
        return self._used_bytes

    def object_count(self) -> int:
        return len(self._index)

    def stats(self) -> TierStats:
        """Base stats; ``detail`` names quarantined files and a load model without a timed read
        (a skipped calibration)."""
        notes = [f"{self.quarantined_count} quarantined"] if self.quarantined_count else []
        notes.append(self.calibration_detail())
        return dataclasses.replace(super().stats(), detail="; ".join(filter(None, notes)))

    # -- put ------------------------------------------------------------------------------

    async def _put(self, meta: ObjectMeta, view: memoryview) -> ObjectMeta:
        pending = self._removing.get(meta.key)
        if pending is not None:  # a delete of this key must unlink before we rename over it
            await pending.wait()
        final = self.layout.object_path(meta.tenant, meta.key)
        with Timer() as t:
            stored = await self.write_file(meta, view, final)
        self._remember(StoredFile(stored, len(encode_header(stored))))
        self.write_meter.record(meta.size_bytes, t.seconds)
        return stored

    async def write_file(self, meta: ObjectMeta, view: memoryview, final: str) -> ObjectMeta:
        """Write ``view`` as an object file at ``final`` (temp → fsync → rename → fsync dir).

        Not indexed: :meth:`put` indexes; calibration uses this for a throwaway file.
        """
        temp = self.layout.temp_path(final)
        try:
            try:
                stored = await self._write_temp(temp, meta, view, self.direct)
            except OSError as e:
                if not (e.errno == errno.EINVAL and self.direct and self.options.o_direct_auto):
                    raise
                logger.warning("ssd tier %s: O_DIRECT write refused (%s); buffered", self.name, e)
                self.direct = False
                await self._io.run(remove_quietly, temp)
                stored = await self._write_temp(temp, meta, view, False)
            await self._io.run(commit_file, temp, final, self.options.fsync)
        except BaseException as e:
            await self._io.run(remove_quietly, temp)
            if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
                raise StorageFullError(
                    f"tier {self.name}: no space for {meta.size_bytes} bytes of {meta.key!r} "
                    f"under {self.layout.root}: {os.strerror(e.errno)}"
                ) from e
            raise
        return stored

    async def _write_temp(
        self, temp: str, meta: ObjectMeta, view: memoryview, direct: bool
    ) -> ObjectMeta:
        assert self._bounce is not None
        fd = await self._io.run(functools.partial(open_file, temp, write=True, direct=direct))
        try:
            header_len = len(encode_header(meta))  # kept_indices fix it; the checksum does not
            parts = plan_parts(meta.size_bytes, self.options.part_bytes, view, direct)
            calls: list[Callable[[], Any]] = [functools.partial(data_checksum, view)]
            calls += [
                functools.partial(write_part, fd, view, header_len, p, self._bounce) for p in parts
            ]
            checksum = (await self._io.run_all(calls))[0]
            if meta.checksum not in (0, checksum):
                raise InvalidArgumentError(
                    f"put {meta.key!r}: checksum {meta.checksum:#x} given, bytes hash to "
                    f"{checksum:#x}"
                )
            stored = meta if meta.checksum == checksum else meta.replace(checksum=checksum)
            await self._io.run(self._finish_file, fd, encode_header(stored), direct)
            return stored
        finally:
            os.close(fd)

    def _finish_file(self, fd: int, header: bytes, direct: bool) -> None:
        assert self._bounce is not None
        _write_header(fd, header, self._bounce, direct)  # last: a file is whole only after it
        if self.options.fsync:
            os.fsync(fd)

    # -- read -----------------------------------------------------------------------------

    async def _read(self, key: str, dst: memoryview) -> ObjectMeta:
        found = self._index.get(key)
        if found is None:
            raise NotFoundError(f"object {key!r} not found in tier {self.name}")
        entry = self._file(found)
        if dst.nbytes < entry.meta.size_bytes:
            raise InvalidArgumentError(
                f"read {key!r}: destination holds {dst.nbytes} bytes, object has "
                f"{entry.meta.size_bytes}"
            )
        with Timer() as t:
            path = self.layout.path_of(entry)
            meta = await self.read_file(entry, path, dst, lambda: self._index.get(key) is found)
        self.read_meter.record(meta.size_bytes, t.seconds)
        return meta

    async def read_file(
        self, entry: StoredFile, path: str, dst: memoryview, current: Callable[[], bool]
    ) -> ObjectMeta:
        """Read and verify ``entry``'s bytes (its file at ``path``) into ``dst``; ``current()``
        says whether the index still holds this very entry (if not, a failed check means
        "deleted meanwhile")."""
        direct = self.direct
        try:
            fd = await self._io.run(functools.partial(open_file, path, write=False, direct=direct))
        except FileNotFoundError as e:
            raise NotFoundError(f"object {entry.meta.key!r} not found in tier {self.name}") from e
        try:
            # The open fd pins the inode: a concurrent delete unlinks the name, not our bytes.
            return await self._read_fd(fd, entry, path, dst, direct=direct, current=current)
        finally:
            os.close(fd)

    async def _read_fd(
        self,
        fd: int,
        entry: StoredFile,
        path: str,
        dst: memoryview,
        *,
        direct: bool,
        current: Callable[[], bool],
    ) -> ObjectMeta:
        assert self._bounce is not None
        meta, where = entry.meta, f"tier {self.name}: {path}"
        parts = plan_parts(meta.size_bytes, self.options.part_bytes, dst, direct)
        calls: list[Callable[[], Any]] = [functools.partial(read_header, fd, self._bounce, where)]
        calls += [
            functools.partial(
                read_part, fd, dst, entry.header_len, p, pool=self._bounce, where=where
            )
            for p in parts
        ]
        hasher = DataHasher()

        def hash_part(i: int, _: object) -> None:
            # On the event loop: xxhash holds the GIL anyway (~0.13 ms per 4 MiB), and hashing
            # part i while parts i+1.. are still read hides the hash behind the I/O.
            if i > 0:
                p = parts[i - 1]
                hasher.update(dst[p.offset : p.offset + p.valid])

        try:
            header = (await self._io.run_all(calls, hash_part))[0]
            if header.meta != meta or header.header_len != entry.header_len:
                raise CorruptObjectError(f"{where}: header does not match the indexed object")
            checksum = hasher.digest()
            if checksum != meta.checksum:
                raise CorruptObjectError(
                    f"{where}: data checksum {checksum:#x}, header says {meta.checksum:#x}"
                )
        except (CorruptObjectError, OSError) as e:
            if isinstance(e, OSError) and e.errno != errno.EIO:
                raise
            if not current():  # replaced or deleted while we read: not corruption
                raise NotFoundError(f"object {meta.key!r} was removed during the read") from e
            await self._quarantine(meta.key, path, os.fstat(fd).st_ino)
            raise CorruptObjectError(f"{e}; the file was quarantined") from e
        return meta

    async def _quarantine(self, key: str, path: str, inode: int) -> None:
        self._forget(key)
        self.quarantined_count += 1
        logger.error("ssd tier %s: quarantining %s (%r)", self.name, path, key)
        await self._remove_file(key, self._io.run(quarantine_file, path, self.layout, inode))

    # -- bookkeeping ----------------------------------------------------------------------

    def _file(self, meta: ObjectMeta) -> StoredFile:
        """The indexed object ``meta`` as a file: with its header length."""
        return StoredFile(meta, self._long_headers.get(meta.key, ALIGN))

    def _remember(self, f: StoredFile) -> None:
        self._changes += 1
        self._index[f.meta.key] = f.meta
        if f.header_len != ALIGN:
            self._long_headers[f.meta.key] = f.header_len
        self._used_bytes += f.meta.size_bytes

    def _forget(self, key: str) -> None:
        self._changes += 1
        meta = self._index.pop(key)
        self._long_headers.pop(key, None)
        self._used_bytes -= meta.size_bytes

    async def _remove_file(self, key: str, removal: Coroutine[Any, Any, Any]) -> None:
        """Run a file removal while puts of ``key`` wait (they would rename onto its name)."""
        done = asyncio.Event()
        self._removing[key] = done
        try:
            await removal
        finally:
            done.set()
            if self._removing.get(key) is done:
                del self._removing[key]


def _unlink_if_present(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):  # already quarantined: the goal holds
        os.unlink(path)
