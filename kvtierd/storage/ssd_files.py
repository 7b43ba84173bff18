"""Directory layout and whole-file operations of the SSD tier (synchronous; run on I/O threads).

Layout under the tier's ``path``::

    objects/<2 hex>/<32 hex>.kvt   committed objects, fanned out by the first byte of the name
    tmp/                           objects being written (removed at start: never committed)
    quarantine/                    files that failed a header or checksum check, kept for autopsy

Objects are written under ``tmp/``, fsynced, renamed into ``objects/`` and the directory is
fsynced: after a crash an object is either complete under its final name or not there at all.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from kvtierd.errors import CorruptObjectError
from kvtierd.storage.aligned_io import fsync_dir
from kvtierd.storage.ssd_format import OBJECT_SUFFIX, decode_header, header_len_from_prefix
from kvtierd.storage.ssd_format import object_name as _object_name
from kvtierd.types import ObjectMeta

_FANOUT = 256


class _TempNames:
    """Temp file names: this process's random token (a forked child draws its own), then a
    count. A uuid4 a file read 16 bytes of os.urandom each: 20% of the SSD I/O threads' time
    in a shutdown flush of 16,384 objects (py-spy, bench_flush). O_EXCL still refuses a name
    in use."""

    def __init__(self) -> None:
        self.renew()
        os.register_at_fork(after_in_child=self.renew)

    def renew(self) -> None:
        self.token = uuid.uuid4().hex[:12]
        self.ids = itertools.count()

    def next(self, stem: str, directory: Path) -> str:
        return f"{directory}/{stem}.{self.token}{next(self.ids):x}.tmp"


_TEMP_NAMES = _TempNames()


class StoredFile(NamedTuple):
    """A committed object found on disk: its metadata and data offset (bytes). Its path is
    not kept: it is the hash of the object's ``(tenant, key)`` (:meth:`Layout.path_of`), and a
    path string an object was ~130 bytes of the index at 1M objects (issue 42). A named tuple:
    a restart makes one a file, and a frozen dataclass took 1 us to make (a tuple 0.1-0.3)."""

    meta: ObjectMeta
    header_len: int


@dataclass(frozen=True, slots=True)
class BadFile:
    """A file that is not a valid object, and why."""

    path: str
    reason: str


@dataclass(frozen=True, slots=True)
class Layout:
    """The tier's directories."""

    root: Path

    @property
    def objects(self) -> Path:
        return self.root / "objects"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    def subdirs(self) -> list[Path]:
        return [self.objects / f"{i:02x}" for i in range(_FANOUT)]

    def object_path(self, tenant: str, key: str) -> str:
        return self.named_path(_object_name(tenant, key))

    def named_path(self, name: str) -> str:
        """Where the object file called ``name`` (:func:`ssd_format.object_name`) is."""
        return f"{self.objects}/{name[:2]}/{name}"

    def path_of(self, f: StoredFile) -> str:
        """Where a committed object's file is (its name checked against its key when found)."""
        return self.object_path(f.meta.tenant, f.meta.key)

    def temp_path(self, final: str) -> str:
        return _TEMP_NAMES.next(os.path.splitext(os.path.basename(final))[0], self.tmp)

    def create(self) -> None:
        """Create every directory (idempotent) and make their names durable."""
        for d in (self.tmp, self.quarantine, *self.subdirs()):
            d.mkdir(parents=True, exist_ok=True)
        fsync_dir(str(self.objects))
        fsync_dir(str(self.root))

    def remove_temp_files(self) -> int:
        """Delete leftovers of writes that never committed; returns how many."""
        removed = 0
        for entry in os.scandir(self.tmp):
            if entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
                removed += 1
        return removed


def scan_subdir(subdir: Path, layout: Layout) -> tuple[list[StoredFile], list[BadFile]]:
    """Read the header of every object file in one fan-out directory.

    A file is bad when its header does not decode, its name is not the hash of its own
    ``(tenant, key)`` (a misplaced or renamed file), or it is shorter than its data.
    """
    good: list[StoredFile] = []
    bad: list[BadFile] = []
    for entry in os.scandir(subdir):
        if not entry.name.endswith(OBJECT_SUFFIX) or not entry.is_file(follow_symlinks=False):
            continue
        try:
            good.append(inspect_file(entry.path, layout))
        except CorruptObjectError as e:
            bad.append(BadFile(entry.path, str(e)))
    return good, bad


def inspect_file(path: str, layout: Layout) -> StoredFile:
    """The committed object file at ``path``, from its header (``CorruptObjectError`` if bad)."""
    with open(path, "rb") as f:
        page = f.read(4096)
        header_len = header_len_from_prefix(page, path)
        raw = page if header_len <= len(page) else page + f.read(header_len - len(page))
        file_bytes = os.fstat(f.fileno()).st_size
    header = decode_header(raw, path)
    meta = header.meta
    if layout.object_path(meta.tenant, meta.key) != path:
        raise CorruptObjectError(f"{path}: file name does not match the key in its header")
    if file_bytes < header.header_len + meta.size_bytes:
        raise CorruptObjectError(
            f"{path}: truncated: {file_bytes} bytes, header says "
            f"{header.header_len + meta.size_bytes}"
        )
    return StoredFile(meta=meta, header_len=header.header_len)


def quarantine_file(path: str, layout: Layout, expect_inode: int | None = None) -> bool:
    """Move ``path`` into ``quarantine/``; False if it is gone or (when ``expect_inode`` is
    given) was replaced by another file meanwhile — then it is not ours to move."""
    try:
        if expect_inode is not None and os.stat(path).st_ino != expect_inode:
            return False
        target = layout.quarantine / f"{Path(path).name}.{time.time_ns()}"
        os.rename(path, target)
    except FileNotFoundError:
        return False
    fsync_dir(str(layout.quarantine))
    return True


def commit_file(temp: str, final: str, sync: bool) -> None:
    """Rename a fully written temp file to its final name, durably when ``sync``."""
    os.rename(temp, final)
    if sync:
        fsync_dir(str(Path(final).parent))


def rewrite_header(path: str, temp: str, header: bytes, old_header_len: int, sync: bool) -> None:
    """Replace the header of the object file at ``path`` by ``header``, its data unchanged:
    the new header and the old file's bytes after ``old_header_len`` (its data and padding)
    go to ``temp``, which is renamed over ``path`` (as a put commits), so a crash leaves the
    old file or the new one, never a torn header. Raises ``FileNotFoundError`` if ``path``
    is gone."""
    try:
        with open(path, "rb") as src, open(temp, "wb") as dst:
            dst.write(header)
            dst.flush()
            _copy_rest(src.fileno(), dst.fileno(), old_header_len, len(header))
            if sync:
                dst.flush()
                os.fsync(dst.fileno())
        commit_file(temp, path, sync)
    except BaseException:
        remove_quietly(temp)
        raise


def _copy_rest(src: int, dst: int, at_src: int, at_dst: int) -> None:
    """Copy ``src`` from ``at_src`` to its end into ``dst`` at ``at_dst``: in the kernel where
    the filesystem allows (no pass of the data through Python), else in 4 MiB reads."""
    left = os.fstat(src).st_size - at_src
    while left > 0:
        try:
            n = os.copy_file_range(src, dst, left, at_src, at_dst)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            piece = os.pread(src, min(left, 4 << 20), at_src)
            n = os.pwrite(dst, piece, at_dst) if piece else 0
        if n == 0:
            raise OSError(errno.EIO, "object file ended before its size while copying it")
        left, at_src, at_dst = left - n, at_src + n, at_dst + n


def remove_quietly(path: str) -> None:
    """Remove a temp file during error cleanup; a missing file is already the goal."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
