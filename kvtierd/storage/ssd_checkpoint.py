"""The SSD tier's index checkpoint: every object file's header fields in one file, so a restart
reads one file instead of one header per object (issue 42: 1M objects).

``<path>/index.ckpt``::

    offset 0    magic (8 bytes), format version (u32), body length (u64), xxh3_64 of the body
    offset 28   body: a JSON list of rows, one per object file:
                [name under objects/, st_ino, st_mtime_ns, st_size, header_len,
                 header JSON fields (ssd_format.meta_doc), kept_indices as hex]

It is written at stop and every ``index_checkpoint_s`` (to a temp name, fsynced, renamed, as an
object is). At start it is trusted only where it agrees with the files: a torn, truncated or
foreign file (length, checksum, magic) or one that does not parse is ignored whole; a file whose
inode, mtime and size are not those of its row (rewritten, or added since the checkpoint: a
SIGKILL after puts) has its header read, as the scan without a checkpoint does; a row whose
file is gone is dropped. A few rows taken from the checkpoint are checked against their files'
headers as well (:data:`SAMPLE`); one that disagrees discards the whole checkpoint.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from kvtierd.errors import CorruptObjectError
from kvtierd.storage.aligned_io import fsync_dir
from kvtierd.storage.ssd_files import BadFile, Layout, StoredFile, inspect_file
from kvtierd.storage.ssd_format import OBJECT_SUFFIX, meta_doc, meta_from_doc

CHECKPOINT_NAME = "index.ckpt"
_MAGIC = b"KVTIDX\r\n"
_VERSION = 1
_HEAD = struct.Struct("<8sIQQ")
SAMPLE = 16  # rows taken from the checkpoint that are also checked against their file's header

Stamp = tuple[int, int, int]  # st_ino, st_mtime_ns, st_size
Row = list[object]


def checkpoint_path(layout: Layout) -> Path:
    return layout.root / CHECKPOINT_NAME


def stamp_files(files: list[StoredFile]) -> list[tuple[StoredFile, Stamp]]:
    """Each file with its stamp now (files gone meanwhile are left out)."""
    out = []
    for f in files:
        try:
            st = os.stat(f.path)
        except FileNotFoundError:
            continue
        out.append((f, (st.st_ino, st.st_mtime_ns, st.st_size)))
    return out


def write_checkpoint(layout: Layout, stamped: list[tuple[StoredFile, Stamp]], sync: bool) -> int:
    """Write the checkpoint of ``stamped`` atomically; returns its size in bytes."""
    cut = len(str(layout.objects)) + 1
    rows = [
        [f.path[cut:], *stamp, f.header_len, meta_doc(f.meta), f.meta.kept_indices.hex()]
        for f, stamp in stamped
    ]
    body = json.dumps(rows, ensure_ascii=False, separators=(",", ":")).encode()
    head = _HEAD.pack(_MAGIC, _VERSION, len(body), xxhash.xxh3_64_intdigest(body))
    final = checkpoint_path(layout)
    temp = final.with_suffix(".ckpt.tmp")
    with open(temp, "wb") as out:
        out.write(head)
        out.write(body)
        out.flush()
        if sync:
            os.fsync(out.fileno())
    os.replace(temp, final)
    if sync:
        fsync_dir(str(layout.root))
    return len(head) + len(body)


def load_checkpoint(layout: Layout) -> tuple[dict[str, Row] | None, str]:
    """The checkpoint's rows by file name, or ``None`` and why it cannot be used."""
    try:
        raw = checkpoint_path(layout).read_bytes()
    except FileNotFoundError:
        return None, "missing"
    except OSError as e:
        return None, f"unreadable ({e.strerror})"
    if len(raw) < _HEAD.size:
        return None, f"torn ({len(raw)} bytes, shorter than its header)"
    magic, version, length, digest = _HEAD.unpack_from(raw)
    if magic != _MAGIC or version != _VERSION:
        return None, f"not an index checkpoint of version {_VERSION}"
    body = memoryview(raw)[_HEAD.size :]
    if len(body) != length or xxhash.xxh3_64_intdigest(body) != digest:
        return None, f"torn ({len(body)} bytes of body, header says {length}, or bad checksum)"
    try:
        rows = json.loads(bytes(body))
        if not isinstance(rows, list):
            raise TypeError("not a list")
        return {str(r[0]): r for r in rows if isinstance(r, list) and len(r) == 7}, ""
    except (ValueError, TypeError, IndexError) as e:
        return None, f"malformed ({e})"


@dataclass
class SubdirScan:
    """One fan-out directory scanned with a checkpoint's help."""

    good: list[StoredFile] = field(default_factory=list)
    bad: list[BadFile] = field(default_factory=list)
    reused: list[StoredFile] = field(default_factory=list)  # taken from the checkpoint
    read: int = 0  # headers read: files the checkpoint does not know as they are
    seen: int = 0  # checkpoint rows whose file is there


def scan_with_checkpoint(subdir: Path, layout: Layout, rows: dict[str, Row]) -> SubdirScan:
    """Every object file of ``subdir``: from its checkpoint row where the file's stamp is the
    row's, else from its header (``ssd_files.scan_subdir``'s checks)."""
    scan = SubdirScan()
    for entry in os.scandir(subdir):
        if not entry.name.endswith(OBJECT_SUFFIX) or not entry.is_file(follow_symlinks=False):
            continue
        row = rows.get(f"{subdir.name}/{entry.name}")
        if row is not None:
            scan.seen += 1
            found = _from_row(row, entry)
            if found is not None:
                scan.good.append(found)
                scan.reused.append(found)
                continue
        scan.read += 1
        try:
            scan.good.append(inspect_file(entry.path, layout))
        except CorruptObjectError as e:
            scan.bad.append(BadFile(entry.path, str(e)))
    return scan


def _from_row(row: Row, entry: os.DirEntry[str]) -> StoredFile | None:
    st = entry.stat(follow_symlinks=False)
    if row[1:4] != [st.st_ino, st.st_mtime_ns, st.st_size]:
        return None  # rewritten or replaced since the checkpoint
    header_len, doc, kept = row[4], row[5], row[6]
    try:
        if type(header_len) is not int or not isinstance(kept, str):
            raise TypeError("header_len or kept_indices ill-typed")
        meta = meta_from_doc(doc, bytes.fromhex(kept))
    except (ValueError, TypeError, KeyError):
        return None  # the header itself says what the file is
    if st.st_size < header_len + meta.size_bytes:
        return None
    return StoredFile(meta=meta, path=entry.path, header_len=header_len)


def disagreeing(sample: list[StoredFile], layout: Layout) -> str:
    """The first of ``sample`` whose file's header says otherwise than its checkpoint row
    (``""``: none)."""
    for f in sample:
        try:
            actual = inspect_file(f.path, layout)
        except (CorruptObjectError, OSError) as e:
            return f"{f.path}: {e}"
        if actual != f:
            return f"{f.path}: its header is not its checkpoint row"
    return ""
