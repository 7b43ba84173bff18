"""Start-up probes of the SSD tier: does the filesystem take O_DIRECT, and how fast is it."""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
from typing import TYPE_CHECKING

import numpy as np

from kvtierd.errors import InvalidArgumentError, StorageFullError
from kvtierd.storage.aligned_io import ALIGN, o_direct_supported, open_file
from kvtierd.storage.arena import advise_huge_pages
from kvtierd.storage.base import Timer
from kvtierd.storage.ssd_files import Layout, StoredFile, remove_quietly
from kvtierd.storage.ssd_format import encode_header
from kvtierd.types import ObjectMeta

if TYPE_CHECKING:
    from kvtierd.storage.ssd import SsdTier

CALIBRATION_SMALL_BYTES = 1 << 20
"""The small calibration object: one short I/O, so its read time shows the per-load overhead
(open, header read, checksum, thread hand-offs) beside little transfer."""
CALIBRATION_MAX_BYTES = 32 << 20
CALIBRATION_SLACK_BYTES = 64 << 10  # a file's header and padding, with room to spare
CALIBRATION_ROUNDS = 2


def calibration_sizes(part_bytes: int, queue_depth: int, free_bytes: int) -> tuple[int, int]:
    """A small object and one of ``queue_depth`` parts (the whole queue busy, the regime of
    large loads), at least 4x larger and at most ``CALIBRATION_MAX_BYTES``: two sizes far
    enough apart for the read fit to tell per-load overhead from bandwidth. On a small disk
    the large one shrinks so that both take at most half of ``free_bytes``; ``(0, 0)`` when
    even that leaves it under 4x the small one."""
    large = min(max(part_bytes * queue_depth, 4 * CALIBRATION_SMALL_BYTES), CALIBRATION_MAX_BYTES)
    room = free_bytes // 2 - CALIBRATION_SMALL_BYTES - 2 * CALIBRATION_SLACK_BYTES
    large = min(large, room // ALIGN * ALIGN)
    if large < 4 * CALIBRATION_SMALL_BYTES:
        return 0, 0
    return CALIBRATION_SMALL_BYTES, large


def probe_o_direct(layout: Layout, option: str | bool) -> bool:
    """Whether to use O_DIRECT: ``option`` False → no; otherwise try an aligned write in
    ``tmp/``. EINVAL (from open or the write) means the filesystem refuses it: with ``"auto"``
    fall back to buffered I/O, with True raise ``InvalidArgumentError``."""
    if option is False:
        return False
    path = str(layout.tmp / "o_direct_probe.tmp")
    try:
        if not o_direct_supported():
            raise OSError(errno.EINVAL, "this platform has no O_DIRECT")
        fd = open_file(path, write=True, direct=True)
        try:
            with mmap.mmap(-1, ALIGN) as page:
                os.pwritev(fd, [page], 0)
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        if option is True:
            raise InvalidArgumentError(
                f"o_direct: true, but {layout.root} refuses O_DIRECT ({e.strerror}); "
                "use o_direct: auto to fall back to buffered I/O"
            ) from e
        return False
    finally:
        remove_quietly(path)
    return True


async def calibrate(tier: SsdTier, layout: Layout) -> str:
    """Write two throwaway objects (:func:`calibration_sizes`) and read them back, alternately,
    ``CALIBRATION_ROUNDS`` times, through the tier's own paths (split into parts, queue depth,
    O_DIRECT, checksum) into memory like the arena's; every transfer goes into the
    tier's meters, so the first load estimate already separates overhead from bandwidth.

    Returns ``""``, or — meters untouched — why it could not run: a disk without room for the
    throwaway objects must not stop the tier from starting and serving what it holds; the
    load model then uses the tier's prior until real reads are timed.
    """
    st = await asyncio.to_thread(os.statvfs, layout.tmp)
    free = st.f_bavail * st.f_frsize
    sizes = calibration_sizes(tier.options.part_bytes, tier.options.queue_depth, free)
    if not sizes[1]:
        need = 2 * (5 * CALIBRATION_SMALL_BYTES + 2 * CALIBRATION_SLACK_BYTES)
        return f"{free} bytes free under {layout.root}, the probe files need {need}"
    # Under tmp/: a crash leaves nothing behind.
    paths = [str(layout.tmp / f"calibration-{n}.kvt") for n in sizes]
    # Not closed explicitly: a failed write's traceback may still reference slices of it;
    # the mapping goes with the last reference. Huge pages, like the arena that real reads
    # fill: O_DIRECT into 4 KiB pages ran 1.5-1.8x slower here (each I/O pins every page).
    mapping = mmap.mmap(-1, max(sizes))
    advise_huge_pages(mapping)
    view = memoryview(mapping)
    try:
        # Random doubles: all but a few exponent bits random, so a compressing filesystem
        # gains little (rng.bytes costs 9x the time: ~60 ms of start-up for 16 MiB).
        np.random.default_rng(0).random(out=np.frombuffer(view, np.float64))
        written: list[tuple[StoredFile, str, float]] = []
        for size, path in zip(sizes, paths, strict=True):
            meta = ObjectMeta(key=f"\x00calibration-{size}", size_bytes=size)
            try:
                with Timer() as t:
                    stored = await tier.write_file(meta, view[:size], path)
            except StorageFullError as e:
                return f"no room for a {size}-byte probe file ({e})"
            written.append((StoredFile(stored, len(encode_header(stored))), path, t.seconds))
        for entry, _, seconds in written:
            tier.write_meter.record(entry.meta.size_bytes, seconds)
        for _ in range(CALIBRATION_ROUNDS):
            for entry, path, _ in written:
                if not tier.direct:  # time the disk, not the page cache the last read filled
                    await asyncio.to_thread(drop_cached_pages, path)
                with Timer() as t:
                    await tier.read_file(entry, path, view, lambda: True)
                tier.read_meter.record(entry.meta.size_bytes, t.seconds)
        return ""
    finally:
        for path in paths:
            remove_quietly(path)


def drop_cached_pages(path: str) -> None:
    """Evict a (written, synced) file from the page cache, where the OS supports it."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fdatasync(fd)  # dirty pages cannot be dropped (a tier with fsync: false)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
