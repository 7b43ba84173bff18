"""Aligned transfers of one object's bytes, in parts, between a ``memoryview`` and its file.

Everything here is synchronous and runs on the SSD tier's I/O threads, one part per call, so
that the tier can keep ``queue_depth`` parts in flight (the disk reads ~1.6x faster at QD16
than at QD1, notes/machine-limits.md). Offsets and lengths are bytes.

With O_DIRECT a part goes straight to/from the caller's view when the view is page-aligned;
otherwise it is staged in a reused bounce buffer. The final partial page of an object (when
``size_bytes`` is not a multiple of 4096) always goes through a bounce buffer: O_DIRECT moves
whole pages, and the caller's view may continue past ``size_bytes`` into memory that belongs
to someone else (e.g. the next object of the shared-memory arena), which we must not overwrite.
Without O_DIRECT every part goes straight to/from the view and nothing is padded.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

from kvtierd.errors import CorruptObjectError
from kvtierd.storage.aligned_io import (
    ALIGN,
    BouncePool,
    copy_bytes,
    is_aligned,
    pread_full,
    pwrite_full,
    round_down,
)
from kvtierd.storage.ssd_format import Header, decode_header, header_len_from_prefix


@dataclass(frozen=True, slots=True)
class Part:
    """One piece of a transfer: ``length`` file bytes at ``offset`` of the data region.

    ``valid`` is how many of them are object bytes (less than ``length`` only for the padded
    final page); ``staged`` means the bytes pass through a bounce buffer.
    """

    offset: int
    length: int
    valid: int
    staged: bool


def plan_parts(size_bytes: int, part_bytes: int, view: memoryview, direct: bool) -> list[Part]:
    """Split a ``size_bytes`` transfer into parts of at most ``part_bytes`` (a multiple of
    4096, no larger than a bounce buffer)."""
    if not direct:
        return [
            Part(off, min(part_bytes, size_bytes - off), min(part_bytes, size_bytes - off), False)
            for off in range(0, size_bytes, part_bytes)
        ]
    body = round_down(size_bytes)
    staged = not is_aligned(view)
    parts = [
        Part(off, min(part_bytes, body - off), min(part_bytes, body - off), staged)
        for off in range(0, body, part_bytes)
    ]
    if size_bytes > body:
        parts.append(Part(body, ALIGN, size_bytes - body, True))
    return parts


def write_part(fd: int, src: memoryview, data_offset: int, part: Part, pool: BouncePool) -> None:
    """Write one part of ``src`` to the file at ``data_offset + part.offset``."""
    at = data_offset + part.offset
    piece = src[part.offset : part.offset + part.valid]
    if not part.staged:
        pwrite_full(fd, piece, at)
        return
    buf = pool.acquire()
    try:
        with memoryview(buf) as staging:
            copy_bytes(staging[: part.valid], piece)
            if part.length > part.valid:  # zero the page tail: no stale bytes reach the disk
                staging[part.valid : part.length] = bytes(part.length - part.valid)
            pwrite_full(fd, staging[: part.length], at)
    finally:
        pool.release(buf)


def read_part(
    fd: int, dst: memoryview, data_offset: int, part: Part, *, pool: BouncePool, where: str
) -> None:
    """Read one part into ``dst``; a file that ends early raises ``CorruptObjectError``."""
    at = data_offset + part.offset
    if not part.staged:
        got = pread_full(fd, dst[part.offset : part.offset + part.length], at)
    else:
        buf = pool.acquire()
        try:
            with memoryview(buf) as staging:
                got = pread_full(fd, staging[: part.length], at)
                n = min(got, part.valid)
                copy_bytes(dst[part.offset : part.offset + n], staging[:n])
        finally:
            pool.release(buf)
    if got < part.valid:
        raise CorruptObjectError(
            f"{where}: truncated: {got} of {part.valid} bytes at data offset {part.offset}"
        )


def write_header(fd: int, header: bytes, pool: BouncePool, direct: bool) -> None:
    """Write the (4096-padded) header at offset 0, staged when O_DIRECT needs alignment."""
    if not direct:
        pwrite_full(fd, memoryview(header), 0)
        return
    with _Staging(pool, len(header)) as staging:
        staging[: len(header)] = header
        pwrite_full(fd, staging[: len(header)], 0)


def read_header(fd: int, pool: BouncePool, where: str) -> Header:
    """Read and decode the header at offset 0 (one page, more if the header announces it)."""
    with _Staging(pool, ALIGN) as first:
        got = pread_full(fd, first[:ALIGN], 0)
        page = bytes(first[:got])
    header_len = header_len_from_prefix(page, where)
    if header_len <= ALIGN:
        return decode_header(page, where)
    with _Staging(pool, header_len) as whole:
        got = pread_full(fd, whole[:header_len], 0)
        return decode_header(whole[:got], where)


class _Staging:
    """An aligned scratch buffer of at least ``nbytes``: a pooled bounce buffer when it fits,
    else a one-off mmap (only for headers with very large ``kept_indices``)."""

    def __init__(self, pool: BouncePool, nbytes: int) -> None:
        self._pool = pool
        self._own = nbytes > pool.size_bytes
        self._buf = mmap.mmap(-1, nbytes) if self._own else pool.acquire()

    def __enter__(self) -> memoryview:
        self._view = memoryview(self._buf)
        return self._view

    def __exit__(self, *exc: object) -> None:
        self._view.release()
        if self._own:
            self._buf.close()
        else:
            self._pool.release(self._buf)
