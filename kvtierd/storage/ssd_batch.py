"""Many small objects written as one batch: one filesystem sync for all their files (issue 42).

One object is one file whatever the path (the format of :mod:`kvtierd.storage.ssd_format`, read
back by the same header scan), but where :meth:`SsdTier.put` fsyncs each file and its directory
(two device flushes per object: 0.02 GB/s for 16 KiB objects, a third of a 256 MiB CPU tier in a
5 s shutdown flush), a batch is made durable the same way as a whole:

1. every object is written to its own temp file under ``tmp/`` (buffered, header and data);
2. one ``syncfs`` of the tier's filesystem makes all those files' bytes durable (``fsync`` of
   each file where ``syncfs`` is not available);
3. each temp file is renamed to its final name;
4. one more ``syncfs`` (else an ``fsync`` of each directory renamed into) makes the names
   durable; only then does the batch return, and only then is any object acknowledged.

A crash (SIGKILL, power loss) anywhere in this leaves each object either complete under its
final name (its bytes were durable before its rename) or not there: what is still under
``tmp/`` is an uncommitted leftover, removed and counted at the next start; a file renamed but
not yet made durable is whole when it is found, and absent otherwise. A torn file is detected
by its header checksum and length at the scan and by its data checksum at every read, as for
any object file.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from pathlib import Path

from kvtierd.errors import InvalidArgumentError
from kvtierd.storage.aligned_io import fsync_dir
from kvtierd.storage.ssd_files import Layout, StoredFile, remove_quietly
from kvtierd.storage.ssd_format import data_checksum, encode_header
from kvtierd.types import ObjectMeta

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_syncfs = getattr(_libc, "syncfs", None)


def sync_filesystem(path: Path) -> bool:
    """``syncfs`` the filesystem holding ``path`` (every dirty page and inode on it is on the
    device when it returns); False where the C library has no ``syncfs``."""
    if _syncfs is None:
        return False
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs {path}: {os.strerror(err)}")
    finally:
        os.close(fd)
    return True


@dataclass(frozen=True, slots=True)
class BatchItem:
    """One object of a batch: its metadata and bytes (the checksum is computed here)."""

    meta: ObjectMeta
    data: memoryview


Temp = tuple[str, str, StoredFile]  # temp path, final path, the object as stored


def write_temps(items: list[BatchItem], layout: Layout) -> list[Temp] | Exception:
    """Step 1 for some of a batch's objects (the tier's I/O threads each take a share): their
    temp files, or the error (after removing what this call wrote), returned, not raised, so
    the caller can remove what the other shares wrote."""
    temps: list[Temp] = []
    try:
        for item in items:
            temps.append(_write_temp(item, layout))
    except Exception as e:
        discard(temps)
        return e
    return temps


def discard(temps: list[Temp]) -> None:
    for temp, _, _ in temps:
        remove_quietly(temp)


def commit_batch(temps: list[Temp], layout: Layout, sync: bool) -> list[StoredFile]:
    """Steps 2-4 (module docstring): the batch's temp files made durable and renamed into
    place; returns the objects as stored. On any error nothing of the batch is left: the temp
    files and the files already renamed are removed, and the error is raised."""
    renamed: list[str] = []
    try:
        if sync and not sync_filesystem(layout.tmp):
            for temp, _, _ in temps:
                _fsync_path(temp)
        for temp, final, _ in temps:
            os.rename(temp, final)
            renamed.append(final)
        if sync and not sync_filesystem(layout.objects):
            for parent in sorted({str(Path(final).parent) for final in renamed}):
                fsync_dir(parent)
    except BaseException:
        discard(temps)
        for final in renamed:  # not acknowledged: the batch fails as a whole
            remove_quietly(final)
        raise
    return [stored for _, _, stored in temps]


def _write_temp(item: BatchItem, layout: Layout) -> Temp:
    meta, view = item.meta, item.data
    checksum = data_checksum(view)
    if meta.checksum not in (0, checksum):
        raise InvalidArgumentError(
            f"put {meta.key!r}: checksum {meta.checksum:#x} given, bytes hash to {checksum:#x}"
        )
    stored = meta if meta.checksum == checksum else meta.replace(checksum=checksum)
    header = encode_header(stored)
    final = layout.object_path(meta.tenant, meta.key)
    temp = layout.temp_path(final)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        _write_all(fd, [memoryview(header), view])
    except BaseException:
        os.close(fd)
        remove_quietly(temp)
        raise
    os.close(fd)
    return temp, final, StoredFile(stored, len(header))


def _write_all(fd: int, pieces: list[memoryview]) -> None:
    """``pwritev`` until every byte of ``pieces`` is written from offset 0."""
    offset = 0
    pieces = [p.cast("B") for p in pieces if p.nbytes]
    while pieces:
        n = os.pwritev(fd, pieces, offset)
        offset += n
        while pieces and n >= pieces[0].nbytes:
            n -= pieces[0].nbytes
            pieces.pop(0)
        if pieces and n:
            pieces[0] = pieces[0][n:]


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
