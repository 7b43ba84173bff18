"""The SSD tier's index checkpoint: every object file's header fields in one file, so a restart
reads one file instead of one header per object (issue 42: 1M objects).

``<path>/index.ckpt``::

    offset 0    magic (8 bytes), format version (u32), body length (u64), xxh3_64 of the body
    offset 28   body, little-endian:
                u32 length, then a JSON list of the distinct "kinds" of the rows:
                    [variant, dtype, shape, layout, tenant] (fields most objects share)
                256 i64: each fan-out directory's st_mtime_ns before the rows were taken
                    (-1: changed too recently to vouch for its files, see below)
                u64 the row count N, then N of each column, rows sorted by file name:
                    st_ino, st_mtime_ns, st_size          (u64, i64, u64: the file's stamp)
                    header_len, kind                      (u32, u32: an index into the kinds)
                    size_bytes, token_count, checksum     (u64)
                    position                              (i64, -1: none)
                    durable                               (u8)
                    file name                             (16 bytes: xxh3_128 of tenant, key)
                    then the lengths (u32) of key, context_id, parent_context_id and the kept
                    indices, then their bytes, each field's strings one after the other

Columns of fixed-width numbers, not a JSON row an object: a restart of 1M objects took ~31 us
a file with JSON rows (30.8 s; most of it checking each row's fields, and a Python object for
each value: ~1.5 KB an object that the memory allocator kept after the restart); here the
shared fields are checked once a kind (~10 us a file at 1M, benchmarks/RESULTS.md).

It is written at stop and every ``index_checkpoint_s`` (to a temp name, fsynced, renamed, as an
object is). At start it is trusted only where it agrees with the files: a torn, truncated or
foreign file (length, checksum, magic) or one that does not parse is ignored whole; a file whose
inode, mtime and size are not those of its row (rewritten, or added since the checkpoint: a
SIGKILL after puts) has its header read, as the scan without a checkpoint does, as has a file
whose row does not check (a kind or a field out of range, a name that is not its key's); a row
whose file is gone is dropped. A few rows taken from the checkpoint are checked against their
files' headers as well (:data:`SAMPLE`); one that disagrees discards the whole checkpoint.

A fan-out directory whose mtime is still the one recorded has had no file added, renamed over
(a put, a header rewrite) or removed since its mtime was read, which was before the rows were
taken from the index: its files are taken from their rows without a ``stat`` each (~25% of a
restart's scan). A directory is recorded only if its mtime was older than a margin when read,
as git treats an index entry as racy: a change in the same clock tick as the last one before
the read would leave the mtime as it was. The margin is :data:`RACY_NS` (50 ms: the kernel
stamps a file system with nanosecond times from a clock that ticks every 1-10 ms), or
:data:`RACY_COARSE_NS` where the mtime is whole seconds (a file system that keeps no more).
A directory within its margin is waited for once, so that the checkpoint a stop writes right
after the flush's last batch still vouches for every directory.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from kvtierd.errors import CorruptObjectError
from kvtierd.storage.aligned_io import ALIGN, fsync_dir
from kvtierd.storage.ssd_files import BadFile, Layout, StoredFile, inspect_file
from kvtierd.storage.ssd_format import (
    MAX_POSITION,
    OBJECT_SUFFIX,
    check_parent_field,
    meta_from_doc,
    name_digest,
)
from kvtierd.types import ObjectKind, ObjectMeta

CHECKPOINT_NAME = "index.ckpt"
_MAGIC = b"KVTIDX\r\n"
_VERSION = 2
_HEAD = struct.Struct("<8sIQQ")
SAMPLE = 16  # rows taken from the checkpoint that are also checked against their file's header
RACY_NS = 50_000_000  # a directory changed this recently is not vouched for (clock ticks)
RACY_COARSE_NS = 2_000_000_000  # the same where mtimes are whole seconds
_FANOUT = 256
_NO_KIND = ObjectKind()  # a row whose kind does not check (never made into an object)

Kind = tuple[str, str, tuple[int, ...], str, str]  # variant, dtype, shape, layout, tenant
# The numeric columns, in their order in the file, and their array type codes.
_NUMBERS = (
    ("ino", "Q"), ("mtime", "q"), ("size", "Q"), ("header_len", "I"), ("kind", "I"),
    ("size_bytes", "Q"), ("token_count", "Q"), ("checksum", "Q"), ("position", "q"),
    ("durable", "B"),
)  # fmt: skip
_COLUMN = {name: i for i, (name, _) in enumerate(_NUMBERS)}
_SHARED = ("header_len", "size_bytes")  # columns whose values many rows share
_STRINGS = ("key", "context_id", "parent", "kept")
_NAME_BYTES = 16


def checkpoint_path(layout: Layout) -> Path:
    return layout.root / CHECKPOINT_NAME


@dataclass(slots=True)
class StampedFiles:
    """Files stamped for a checkpoint, as columns: the object, its header length, its name's
    digest (``ssd_format.name_digest``, 16 bytes a file) and its stamp now (inode, mtime,
    size). Columns, not a tuple a file: a checkpoint is written every ``index_checkpoint_s``
    while puts go on, and tuples of a stat, a digest and a file per object were ~800 bytes
    an object that the allocator kept after each (issue 42: at 300k puts with a checkpoint
    every 20 s the daemon grew 1,892 bytes an object, without checkpoints 1,027)."""

    metas: list[ObjectMeta] = field(default_factory=list)
    header_len: array = field(default_factory=lambda: array("I"))  # type: ignore[type-arg]
    digests: bytearray = field(default_factory=bytearray)
    ino: array = field(default_factory=lambda: array("Q"))  # type: ignore[type-arg]
    mtime: array = field(default_factory=lambda: array("q"))  # type: ignore[type-arg]
    size: array = field(default_factory=lambda: array("Q"))  # type: ignore[type-arg]

    def __len__(self) -> int:
        return len(self.metas)

    def select(self, keep: list[bool]) -> StampedFiles:
        """The files ``keep`` marks, in order."""
        if all(keep):
            return self
        out = StampedFiles()
        for i in (i for i, k in enumerate(keep) if k):
            out.metas.append(self.metas[i])
            out.header_len.append(self.header_len[i])
            out.digests += self.digests[i * _NAME_BYTES : (i + 1) * _NAME_BYTES]
            out.ino.append(self.ino[i])
            out.mtime.append(self.mtime[i])
            out.size.append(self.size[i])
        return out


def stamp_files(files: Iterable[tuple[ObjectMeta, int]], layout: Layout) -> StampedFiles:
    """Each file ``(meta, header length)`` (a :class:`StoredFile`) with its name's digest and
    its stamp now (files gone meanwhile are left out)."""
    out = StampedFiles()
    for meta, header_len in files:
        digest = name_digest(meta.tenant, meta.key)
        try:
            st = os.stat(layout.named_path(digest.hex() + OBJECT_SUFFIX))
        except FileNotFoundError:
            continue
        out.metas.append(meta)
        out.header_len.append(header_len)
        out.digests += digest
        out.ino.append(st.st_ino)
        out.mtime.append(st.st_mtime_ns)
        out.size.append(st.st_size)
    return out


def stamp_dirs(layout: Layout) -> list[int]:
    """Each fan-out directory's mtime now, or -1 where it changed within its margin (module
    docstring); the directories within it are waited for once, and read again."""
    dirs = layout.subdirs()
    read_at = time.time_ns()
    stamps = [os.stat(d).st_mtime_ns for d in dirs]
    # (a directory stamped in the future, after a step back of the clock, is not waited for:
    # it is not vouched for either)
    racy = [_racy_until(m) > read_at and m <= read_at for m in stamps]
    if any(racy):
        wait = max(_racy_until(m) for m, r in zip(stamps, racy, strict=True) if r) - read_at
        time.sleep(wait / 1e9)
    now = time.time_ns()
    out = []
    for d, before, again in zip(dirs, stamps, racy, strict=True):
        mtime = os.stat(d).st_mtime_ns if again else before
        out.append(mtime if mtime == before and _racy_until(mtime) <= now else -1)
    return out


def _racy_until(mtime: int) -> int:
    """When a directory last changed at ``mtime`` can be vouched for."""
    return mtime + (RACY_COARSE_NS if mtime % 1_000_000_000 == 0 else RACY_NS)


def _kind(meta: ObjectMeta) -> Kind:
    return meta.variant, meta.dtype, meta.shape, meta.layout, meta.tenant


def _little(a: array) -> bytes:  # type: ignore[type-arg]
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def encode(dirs: list[int], stamped: StampedFiles) -> bytes:
    """The checkpoint's body of the directories' stamps ``dirs`` (:func:`stamp_dirs`, taken
    before the rows) and the files ``stamped`` (module docstring). Each column is built as an
    array from a generator, and each field's strings into one buffer: no list of an object a
    row (a loop over rows making tuples took ~7 us an object, 16 s at 1M objects)."""
    names = np.frombuffer(bytes(stamped.digests), dtype=">u8").reshape(-1, 2)
    order = np.lexsort((names[:, 1], names[:, 0])).tolist()  # the names' byte order
    metas = [stamped.metas[i] for i in order]
    kinds: dict[Kind, int] = {}
    columns: dict[str, Iterable[int]] = {
        "ino": (stamped.ino[i] for i in order),
        "mtime": (stamped.mtime[i] for i in order),
        "size": (stamped.size[i] for i in order),
        "header_len": (stamped.header_len[i] for i in order),
        "kind": (kinds.setdefault(_kind(m), len(kinds)) for m in metas),
        "size_bytes": (m.size_bytes for m in metas),
        "token_count": (m.token_count for m in metas),
        "checksum": (m.checksum for m in metas),
        "position": (-1 if m.position is None else m.position for m in metas),
        "durable": (int(m.durable) for m in metas),
    }
    numbers = [_little(array(code, columns[name])) for name, code in _NUMBERS]
    strings = {
        "key": (m.key.encode() for m in metas),
        "context_id": (m.context_id.encode() for m in metas),
        "parent": (m.parent_context_id.encode() for m in metas),
        "kept": (m.kept_indices for m in metas),
    }
    lengths, blobs = zip(*(_joined(strings[name]) for name in _STRINGS), strict=True)
    kinds_json = json.dumps([[*k[:2], list(k[2]), *k[3:]] for k in kinds], ensure_ascii=False)
    parts = [struct.pack("<I", len(kinds_json.encode())), kinds_json.encode()]
    parts.append(_little(array("q", dirs)))
    parts.append(struct.pack("<Q", len(metas)))
    parts += numbers
    parts.append(names[order].tobytes())
    parts += [*lengths, *blobs]
    return b"".join(parts)


def _joined(values: Iterable[bytes]) -> tuple[bytes, bytes]:
    """The lengths (u32, little-endian) of ``values`` and their bytes one after the other."""
    lengths, joined = array("I"), bytearray()
    for value in values:
        lengths.append(len(value))
        joined += value
    return _little(lengths), bytes(joined)


def write_checkpoint(layout: Layout, dirs: list[int], stamped: StampedFiles, sync: bool) -> int:
    """Write the checkpoint (:func:`encode`) atomically; returns its size in bytes."""
    body = encode(dirs, stamped)
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


class _Reader:
    """Takes the body's fields in order; ``ValueError`` where the body ends early."""

    def __init__(self, body: bytes) -> None:
        self.body, self.at = body, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.body):
            raise ValueError(f"ends at byte {len(self.body)}, a field wants {self.at + n}")
        piece = self.body[self.at : self.at + n]
        self.at += n
        return piece

    def column(self, code: str, n: int) -> array:  # type: ignore[type-arg]
        a = array(code)
        a.frombytes(self.take(a.itemsize * n))
        if sys.byteorder != "little":
            a.byteswap()
        return a


@dataclass
class Checkpoint:
    """A decoded checkpoint: its columns (module docstring), rows sorted by file name."""

    count: int
    dirs: list[int]  # each fan-out directory's recorded mtime (-1: not vouched for)
    kinds: list[Kind | None]  # None: a kind whose fields do not check (its rows are read)
    numbers: dict[str, array]  # type: ignore[type-arg]
    names: bytes
    lengths: dict[str, array]  # type: ignore[type-arg]
    blobs: dict[str, bytes]
    # Per fan-out directory (the file name's first byte): its rows' range, and where each
    # string field's bytes of its first row start.
    ranges: list[tuple[int, int]] = field(default_factory=list)
    starts: list[dict[str, int]] = field(default_factory=list)
    # One int object for each value of a shared column (an int above 256 is an object of
    # 28-36 bytes: the size and header length of 1M objects of a few sizes, ~56 MB otherwise).
    shared: dict[int, int] = field(default_factory=dict)
    # One string for each context id: a context's chunks (and its children's) name it once
    # each, one copy an object otherwise (~60 bytes and more: LMCache's chunks of one prompt).
    context_ids: dict[str, str] = field(default_factory=dict)
    # The ObjectKind of each (kind, token count, durable) the rows name: one lookup a row.
    object_kinds: dict[tuple[int, int, int], ObjectKind] = field(default_factory=dict)

    def object_kind(self, kind_at: int, token_count: int, durable: int) -> ObjectKind:
        """The ObjectKind of a row that checked (its kind is one of :attr:`kinds`)."""
        found = self.object_kinds.get((kind_at, token_count, durable))
        if found is None:
            kind = self.kinds[kind_at] if kind_at < len(self.kinds) else None
            if kind is None:
                return _NO_KIND  # its row does not check: left out by _rows_of
            variant, dtype, shape, layout, tenant = kind
            found = self.object_kinds[kind_at, token_count, durable] = ObjectKind.of(
                variant=variant, dtype=dtype, shape=shape, layout=layout, tenant=tenant,
                token_count=token_count, durable=durable == 1,
            )  # fmt: skip
        return found


def load_checkpoint(layout: Layout) -> tuple[Checkpoint | None, str]:
    """The checkpoint, or ``None`` and why it cannot be used."""
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
    body = raw[_HEAD.size :]
    del raw
    if len(body) != length or xxhash.xxh3_64_intdigest(body) != digest:
        return None, f"torn ({len(body)} bytes of body, header says {length}, or bad checksum)"
    try:
        return _decode(body), ""
    except (ValueError, TypeError, IndexError, OverflowError) as e:
        return None, f"malformed ({e})"


def _decode(body: bytes) -> Checkpoint:
    r = _Reader(body)
    (kinds_len,) = struct.unpack("<I", r.take(4))
    kinds = [_checked_kind(k) for k in json.loads(r.take(kinds_len).decode())]
    dirs = r.column("q", _FANOUT).tolist()
    (n,) = struct.unpack("<Q", r.take(8))
    if n > len(body):  # every row takes more than a byte: a count this large is damage
        raise ValueError(f"{n} rows in {len(body)} bytes")
    numbers = {name: r.column(code, n) for name, code in _NUMBERS}
    names = r.take(_NAME_BYTES * n)
    lengths = {name: r.column("I", n) for name in _STRINGS}
    blobs = {name: r.take(sum(lengths[name])) for name in _STRINGS}
    if r.at != len(body):
        raise ValueError(f"{len(body) - r.at} bytes after the last field")
    ckpt = Checkpoint(n, dirs, kinds, numbers, names, lengths, blobs)
    at = dict.fromkeys(_STRINGS, 0)
    lo = 0
    for first in range(_FANOUT):
        hi = lo
        while hi < n and names[_NAME_BYTES * hi] == first:
            hi += 1
        ckpt.ranges.append((lo, hi))
        ckpt.starts.append(dict(at))
        for name in _STRINGS:
            at[name] += sum(lengths[name][lo:hi])
        lo = hi
    if lo != n:
        raise ValueError("rows are not sorted by file name")
    return ckpt


def _checked_kind(k: object) -> Kind | None:
    """A kind's fields as ``meta_from_doc`` checks them in a header (``None``: they do not)."""
    if not isinstance(k, list) or len(k) != 5:
        return None
    doc = {
        "key": "", "context_id": "", "variant": k[0], "dtype": k[1], "shape": k[2],
        "layout": k[3], "tenant": k[4], "size_bytes": 0, "token_count": 0, "checksum": "0" * 16,
    }  # fmt: skip
    try:
        meta = meta_from_doc(doc, b"")
    except (ValueError, TypeError, KeyError):
        return None
    return _kind(meta)


@dataclass
class SubdirScan:
    """One fan-out directory scanned with a checkpoint's help."""

    good: list[StoredFile] = field(default_factory=list)
    bad: list[BadFile] = field(default_factory=list)
    reused: list[StoredFile] = field(default_factory=list)  # taken from the checkpoint
    read: int = 0  # headers read: files the checkpoint does not know as they are
    seen: int = 0  # checkpoint rows whose file is there


def scan_with_checkpoint(subdir: Path, layout: Layout, ckpt: Checkpoint) -> SubdirScan:
    """Every object file of ``subdir``: from its checkpoint row where the file's stamp is the
    row's and the row checks, else from its header (``ssd_files.scan_subdir``'s checks)."""
    first = int(subdir.name, 16)
    rows = _rows_of(ckpt, first)
    unchanged = ckpt.dirs[first] != -1 and os.stat(subdir).st_mtime_ns == ckpt.dirs[first]
    scan = SubdirScan()
    for entry in os.scandir(subdir):
        if not entry.name.endswith(OBJECT_SUFFIX) or not entry.is_file(follow_symlinks=False):
            continue
        row = rows.get(entry.name)
        if row is not None:
            scan.seen += 1
            found = _from_row(row, ckpt, None if unchanged else entry)
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


# One row that checks: its file name's digest; the file's stamp (st_ino, st_mtime_ns,
# st_size); header_len, size_bytes, checksum, position (None: not numbered); its ObjectKind;
# the bytes of key, context_id, parent_context_id and the kept indices.
_Row = tuple[bytes, int, int, int, int, int, int, "int | None", ObjectKind, bytes, bytes, bytes,
             bytes]  # fmt: skip


def _rows_of(ckpt: Checkpoint, first: int) -> dict[str, _Row]:
    """The rows of the fan-out directory ``first`` (a file name's first byte) by file name,
    those whose numbers check (a kind that checked, a position, durable flag and header length
    in range, a file long enough for its header and data) checked at once, with numpy: a file
    whose row does not check is not in it (its header is read)."""
    lo, hi = ckpt.ranges[first]
    col = {name: np.frombuffer(ckpt.numbers[name], dtype=np.dtype(code))[lo:hi]
           for name, code in _NUMBERS}  # fmt: skip
    kind_ok = np.array([k is not None for k in ckpt.kinds] + [False], dtype=bool)
    size, header_len = col["size"], col["header_len"].astype(np.uint64)
    ok = (
        kind_ok[np.minimum(col["kind"], len(ckpt.kinds))]
        & (col["position"] >= -1) & (col["position"] <= MAX_POSITION) & (col["durable"] <= 1)
        & (header_len >= ALIGN) & (header_len % ALIGN == 0)
        & (size >= header_len) & (size - np.minimum(size, header_len) >= col["size_bytes"])
    )  # fmt: skip
    shared = ckpt.shared
    header_lens = [shared.setdefault(v, v) for v in col["header_len"].tolist()]
    sizes = [shared.setdefault(v, v) for v in col["size_bytes"].tolist()]
    positions = [None if p < 0 else p for p in col["position"].tolist()]
    kind_of = ckpt.object_kind
    kinds = list(map(kind_of, col["kind"].tolist(), col["token_count"].tolist(),
                     col["durable"].tolist()))  # fmt: skip
    strings = []
    for name in _STRINGS:
        blob, at, pieces = ckpt.blobs[name], ckpt.starts[first][name], []
        for length in ckpt.lengths[name][lo:hi]:
            pieces.append(blob[at : at + length])
            at += length
        strings.append(pieces)
    names = [ckpt.names[_NAME_BYTES * i : _NAME_BYTES * (i + 1)] for i in range(lo, hi)]
    stamps = col["ino"].tolist(), col["mtime"].tolist(), size.tolist()
    rows = zip(names, *stamps, header_lens, sizes, col["checksum"].tolist(), positions, kinds,
               *strings, strict=True)  # fmt: skip
    return {
        name.hex() + OBJECT_SUFFIX: row
        for name, row, good in zip(names, rows, ok.tolist(), strict=True)
        if good
    }


def _from_row(row: _Row, ckpt: Checkpoint, entry: os.DirEntry[str] | None) -> StoredFile | None:
    """The file as its row says, or ``None`` where the row does not check or (when its
    ``entry`` is given: its directory changed) the file's stamp is not the row's."""
    (digest, ino, mtime, size, header_len, size_bytes, checksum, position, kind, raw_key,
     raw_context, raw_parent, kept) = row  # fmt: skip
    if entry is not None:
        st = entry.stat(follow_symlinks=False)
        if (ino, mtime, size) != (st.st_ino, st.st_mtime_ns, st.st_size):
            return None  # rewritten or replaced since the checkpoint
    try:
        key, context_id = raw_key.decode(), raw_context.decode()
        parent = check_parent_field(raw_parent.decode(), context_id, key) if raw_parent else ""
    except (ValueError, TypeError):
        return None
    if name_digest(kind.tenant, key) != digest:
        return None  # a row naming another file's key
    context_id = ckpt.context_ids.setdefault(context_id, context_id)
    if parent:
        parent = ckpt.context_ids.setdefault(parent, parent)
    meta = ObjectMeta.of_kind(key, size_bytes, context_id, kind, kept_indices=kept,
                              checksum=checksum, parent_context_id=parent,
                              position=position)  # fmt: skip
    return StoredFile(meta, header_len)


def disagreeing(sample: list[StoredFile], layout: Layout) -> str:
    """The first of ``sample`` whose file's header says otherwise than its checkpoint row
    (``""``: none)."""
    for f in sample:
        path = layout.path_of(f)
        try:
            actual = inspect_file(path, layout)
        except (CorruptObjectError, OSError) as e:
            return f"{path}: {e}"
        if actual != f:
            return f"{path}: its header is not its checkpoint row"
    return ""
