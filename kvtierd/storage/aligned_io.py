"""Aligned-I/O helpers for O_DIRECT: alignment arithmetic, buffer addresses, bounce buffers.

O_DIRECT bypasses the page cache, so the kernel DMA's straight to or from the caller's memory;
it therefore requires the buffer address, the transfer length and the file offset to be
multiples of the device's logical block size. We use :data:`ALIGN` = 4096 bytes, which covers
every common device (512 B and 4 KiB sectors) and matches the page size, so page-aligned
shared-memory regions qualify as they are.

Buffers that are not aligned go through a :class:`BouncePool`: a fixed set of page-aligned
anonymous ``mmap`` buffers reused for every transfer — a fresh large allocation per object
costs ~10x the copy in page faults (notes/machine-limits.md).
"""

from __future__ import annotations

import errno
import mmap
import os
import queue

import numpy as np

from kvtierd.errors import InvalidArgumentError

ALIGN = 4096
"""Alignment in bytes of O_DIRECT buffer addresses, lengths and file offsets."""

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def round_up(n: int, align: int = ALIGN) -> int:
    """Smallest multiple of ``align`` that is >= ``n`` (bytes)."""
    return (n + align - 1) // align * align


def round_down(n: int, align: int = ALIGN) -> int:
    """Largest multiple of ``align`` that is <= ``n`` (bytes)."""
    return n // align * align


def buffer_address(view: memoryview) -> int:
    """Virtual address of the first byte of a contiguous, non-empty ``view``.

    Goes through numpy because ``ctypes.c_char.from_buffer`` refuses read-only buffers and a
    ``put`` may well be handed the bytes of an immutable object.
    """
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def byte_view(data: memoryview, what: str) -> memoryview:
    """``data`` as a flat unsigned-byte view; non-contiguous buffers cannot be moved as one."""
    if not data.c_contiguous:
        raise InvalidArgumentError(f"{what} must be a C-contiguous buffer")
    return data if data.format == "B" and data.ndim == 1 else data.cast("B")


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` (same length) without holding the GIL during the copy.

    A memoryview slice assignment copies under the GIL, which serializes the I/O threads'
    bounce copies with each other and with the event loop (measured: unaligned reads capped
    at ~1 GB/s); numpy releases the GIL for a plain byte copy.
    """
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def is_aligned(view: memoryview, align: int = ALIGN) -> bool:
    """Whether ``view`` starts at an ``align``-byte boundary (an empty view never is)."""
    return view.nbytes > 0 and buffer_address(view) % align == 0


def o_direct_supported() -> bool:
    """Whether this platform defines O_DIRECT at all (Linux does; macOS does not)."""
    return _O_DIRECT != 0


def open_file(path: str, *, write: bool, direct: bool) -> int:
    """Open ``path`` for a whole-object write (created, must not exist) or for reading.

    With ``direct`` the file is opened with O_DIRECT; filesystems without it (some FUSE, older
    tmpfs) raise ``OSError(EINVAL)``, which the caller takes as the cue to fall back.
    """
    flags = os.O_CLOEXEC
    flags |= os.O_WRONLY | os.O_CREAT | os.O_EXCL if write else os.O_RDONLY
    if direct:
        flags |= _O_DIRECT
    return os.open(path, flags, 0o600)


def pwrite_full(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset`` (bytes), looping over short writes."""
    done = 0
    total = view.nbytes
    while done < total:
        n = os.pwritev(fd, [view[done:]], offset + done)
        if n <= 0:  # a zero-byte write would loop forever; the kernel means "no room"
            raise OSError(errno.ENOSPC, "short write returned 0 bytes")
        done += n


def pread_full(fd: int, view: memoryview, offset: int) -> int:
    """Read into ``view`` from ``offset`` until it is full or the file ends; bytes read."""
    done = 0
    total = view.nbytes
    while done < total:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:  # end of file
            break
        done += n
    return done


def fsync_dir(path: str) -> None:
    """fsync a directory so a rename or unlink inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BouncePool:
    """A fixed pool of page-aligned ``size_bytes`` buffers (anonymous mmap), reused forever.

    ``acquire`` blocks while all are in use; with as many buffers as I/O threads it never
    waits. Thread-safe: buffers are taken and returned on worker threads.
    """

    def __init__(self, count: int, size_bytes: int) -> None:
        if count < 1 or size_bytes < ALIGN or size_bytes % ALIGN:
            raise ValueError(
                f"bounce pool needs count >= 1 and a size that is a multiple of {ALIGN}, "
                f"got count={count} size_bytes={size_bytes}"
            )
        self.size_bytes = size_bytes
        self._maps = [mmap.mmap(-1, size_bytes) for _ in range(count)]
        self._free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        for m in self._maps:
            self._free.put(m)

    def acquire(self) -> mmap.mmap:
        return self._free.get()

    def release(self, buf: mmap.mmap) -> None:
        self._free.put(buf)

    def close(self) -> None:
        """Drop the buffers; call only when no transfer is in flight.

        Not ``mmap.close()``: the traceback of a failed transfer may still reference a view of
        a buffer (BufferError); each mapping goes away with its last reference instead.
        """
        self._maps.clear()
        while not self._free.empty():
            self._free.get_nowait()
