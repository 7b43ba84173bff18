"""The on-disk format of an SSD-tier object file (DESIGN.md §3.5: self-describing files).

One object = one file::

    offset 0            fixed prefix (32 bytes, little-endian, see _PREFIX)
    offset 32           metadata as UTF-8 JSON (key, context_id, variant, dtype, shape, layout,
                        token_count, tenant, size_bytes, checksum as 16 hex digits; durable:
                        true only for an object committed durable;
                        parent_context_id: only for a child context's object;
                        position: the object's place in its context, absent in files
                        written before issue 31)
    then                kept_indices, raw bytes (opaque int32 array, often the largest field)
    then                zero padding up to header_len (a multiple of 4096)
    offset header_len   the object's raw bytes (size_bytes), zero-padded to a multiple of 4096
                        when written with O_DIRECT

The prefix holds the magic, the format version, ``header_len``, the lengths of the JSON and the
kept indices, and ``header_checksum`` = xxh3_64 of the whole header up to the padding with that
field zeroed, so a damaged header is detected before any field is trusted. The data checksum
(``checksum`` in the JSON, xxh3_64 of the ``size_bytes`` data bytes) is verified on every read.
The index can be rebuilt from these headers alone.

File names are xxh3_128 of ``(tenant, key)`` in hex — no client string ever reaches a path.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import xxhash

from kvtierd.errors import CorruptObjectError
from kvtierd.storage.aligned_io import ALIGN, round_up
from kvtierd.types import ObjectMeta

MAGIC = b"KVTSSD\r\n"  # \r\n catches files mangled by newline conversion, as PNG's magic does
FORMAT_VERSION = 1
OBJECT_SUFFIX = ".kvt"
_PREFIX = struct.Struct("<8sHHIIIQ")  # magic, version, flags, header_len, json_len, kept_len, sum
PREFIX_BYTES = _PREFIX.size
_MAX_HEADER_BYTES = 64 << 20  # a header this large is damage, not a real object
_STR_FIELDS = ("key", "context_id", "variant", "dtype", "layout", "tenant")
_INT_FIELDS = ("size_bytes", "token_count")
# Fields most objects share a value of: a decoded header (or checkpoint row) had its own copy
# of "none", "uint8", the layout and the tenant, ~200 bytes an object at 1M objects.
_SHARED_FIELDS = ("variant", "dtype", "layout", "tenant")


MAX_ID_BYTES = 1024  # engine/validate.py's MAX_KEY_BYTES: what a put may name


def check_parent_field(parent: object, context_id: object, key: object) -> str:
    """``parent_context_id`` of a stored header (absent in files written before issue 29:
    a root), refused by name unless it is a context id a put could have given: a string of
    at most ``MAX_ID_BYTES`` bytes, without NUL, not the object's own context (a context
    cannot continue itself). Raises ``ValueError``/``TypeError`` (the decoders' corruption)."""
    if not isinstance(parent, str):
        raise TypeError(f"parent_context_id is {type(parent).__name__}, not a string")
    if "\x00" in parent or len(parent.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
        raise ValueError(
            f"parent_context_id must be a context id of at most {MAX_ID_BYTES} bytes without NUL"
        )
    own = context_id or key  # ObjectMeta.context: an object without one is its own context
    if parent and parent == own:
        raise ValueError(
            f"parent_context_id {parent!r} is the object's own context: a context cannot "
            "continue itself (allowed: another context's id, or absent for a root)"
        )
    return parent


MAX_POSITION = (1 << 31) - 1
"""The highest position a header may carry: far more chunks than a context ever holds (a
position grows by one per chunk put into its context), and an integer every JSON reader keeps
exactly."""


def check_position_field(position: object) -> int | None:
    """``position`` of a stored header (``None``: absent, a file written before issue 31),
    refused by name unless it is an integer in ``[0, MAX_POSITION]``. Raises
    ``ValueError``/``TypeError`` (the decoders' corruption)."""
    if position is None:
        return None
    if type(position) is not int:  # bool is an int to isinstance; a position is not a bool
        raise TypeError(f"position is {type(position).__name__}, not an integer")
    if not 0 <= position <= MAX_POSITION:
        raise ValueError(f"position {position} is not an integer in [0, {MAX_POSITION}]")
    return position


def duplicate_positions(metas: Iterable[ObjectMeta]) -> dict[str, str]:
    """The objects that share their position with another of the same context and variant
    (its chunks of one form are numbered once each; a quantized variant's chunk carries its
    original's position, kept apart as the reference copy): key -> why it is refused. Every
    claimant is refused: nothing says which one holds the place (damaged or hostile files)."""
    claims: dict[tuple[str, str, str, int], list[str]] = {}
    for meta in metas:
        if meta.position is not None:
            place = (meta.tenant, meta.context, meta.variant, meta.position)
            claims.setdefault(place, []).append(meta.key)
    return {
        key: (
            f"position {place[3]} of context {place[1]!r} is claimed by {len(keys)} objects "
            f"of its form {place[2]!r} (allowed: one object per position and form)"
        )
        for place, keys in claims.items()
        if len(keys) > 1
        for key in keys
    }


def object_name(tenant: str, key: str) -> str:
    """The file name of ``(tenant, key)``: 32 hex digits of xxh3_128 plus the suffix."""
    return name_digest(tenant, key).hex() + OBJECT_SUFFIX


def name_digest(tenant: str, key: str) -> bytes:
    """The 16 bytes whose hex is :func:`object_name`'s (without its suffix)."""
    return xxhash.xxh3_128_digest(f"{len(tenant)}:{tenant}\x00{key}".encode())


def data_checksum(view: memoryview) -> int:
    """xxh3_64 of the object's bytes, as stored in ``ObjectMeta.checksum``."""
    return int(xxhash.xxh3_64_intdigest(view))


class DataHasher:
    """Incremental :func:`data_checksum`: ``update`` with consecutive pieces, then ``digest``."""

    def __init__(self) -> None:
        self._state = xxhash.xxh3_64()

    def update(self, piece: memoryview) -> None:
        self._state.update(piece)

    def digest(self) -> int:
        return int(self._state.intdigest())


@dataclass(frozen=True, slots=True)
class Header:
    """A decoded header: the object's metadata and where its data starts (bytes)."""

    meta: ObjectMeta
    header_len: int


def encode_header(meta: ObjectMeta) -> bytes:
    """Serialize ``meta`` (with its data checksum set) into a header padded to 4096 bytes."""
    body = json.dumps(meta_doc(meta), ensure_ascii=False, separators=(",", ":")).encode()
    used = PREFIX_BYTES + len(body) + len(meta.kept_indices)
    header_len = round_up(used, ALIGN)
    out = bytearray(header_len)
    out[PREFIX_BYTES : PREFIX_BYTES + len(body)] = body
    out[PREFIX_BYTES + len(body) : used] = meta.kept_indices
    args = (MAGIC, FORMAT_VERSION, 0, header_len, len(body), len(meta.kept_indices))
    _PREFIX.pack_into(out, 0, *args, 0)
    checksum = xxhash.xxh3_64_intdigest(memoryview(out)[:used])
    _PREFIX.pack_into(out, 0, *args, checksum)
    return bytes(out)


def meta_doc(meta: ObjectMeta) -> dict[str, object]:
    """The header's JSON fields of ``meta`` (all but ``kept_indices``, stored raw after them);
    :func:`meta_from_doc` reads them back, checking each."""
    doc: dict[str, object] = {name: getattr(meta, name) for name in _STR_FIELDS + _INT_FIELDS}
    doc["shape"] = list(meta.shape)
    # Fixed width, so the header length (= the data offset) is known before the checksum is.
    doc["checksum"] = f"{meta.checksum:016x}"
    if meta.durable:  # only when set: headers of other objects stay as earlier versions wrote
        doc["durable"] = True
    if meta.parent_context_id:  # likewise (issue 29: contexts that form a tree)
        doc["parent_context_id"] = meta.parent_context_id
    if meta.position is not None:
        doc["position"] = meta.position
    return doc


def header_len_from_prefix(prefix: bytes, where: str) -> int:
    """The total header length (bytes) announced by the first ``PREFIX_BYTES`` of a file.

    Lets a reader that fetched one page learn whether it must read more before decoding.
    """
    if len(prefix) < PREFIX_BYTES:
        raise CorruptObjectError(f"{where}: file too short for a header ({len(prefix)} bytes)")
    magic, version, _flags, header_len, _j, _k, _sum = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise CorruptObjectError(f"{where}: bad magic {magic!r}, not a kvtierd SSD object")
    if version != FORMAT_VERSION:
        raise CorruptObjectError(
            f"{where}: format version {version}, this build reads {FORMAT_VERSION}"
        )
    if header_len < ALIGN or header_len % ALIGN or header_len > _MAX_HEADER_BYTES:
        raise CorruptObjectError(f"{where}: implausible header length {header_len}")
    return int(header_len)


def decode_header(raw: bytes | memoryview, where: str) -> Header:
    """Parse and verify a header (at least ``header_len`` bytes of the file's start).

    Raises ``CorruptObjectError`` naming ``where`` for any inconsistency: bad magic, unknown
    version, bad lengths, header checksum mismatch, malformed or ill-typed JSON fields.
    """
    raw = bytes(raw[: min(len(raw), _MAX_HEADER_BYTES)])
    header_len = header_len_from_prefix(raw, where)
    _m, _v, _f, _h, json_len, kept_len, stored_sum = _PREFIX.unpack_from(raw)
    used = PREFIX_BYTES + json_len + kept_len
    if used > header_len or len(raw) < header_len:
        raise CorruptObjectError(f"{where}: header fields overrun the header ({used} bytes)")
    zeroed = bytearray(raw[:used])
    zeroed[PREFIX_BYTES - 8 : PREFIX_BYTES] = bytes(8)
    if xxhash.xxh3_64_intdigest(bytes(zeroed)) != stored_sum:
        raise CorruptObjectError(f"{where}: header checksum mismatch")
    try:
        doc = json.loads(raw[PREFIX_BYTES : PREFIX_BYTES + json_len].decode())
        meta = meta_from_doc(doc, raw[PREFIX_BYTES + json_len : used])
    except (ValueError, TypeError, KeyError) as e:
        raise CorruptObjectError(f"{where}: malformed header metadata: {e}") from e
    return Header(meta=meta, header_len=header_len)


def meta_from_doc(doc: object, kept: bytes) -> ObjectMeta:
    """The metadata a header's JSON fields ``doc`` and raw ``kept`` indices describe; raises
    ``ValueError``/``TypeError``/``KeyError`` for any field that is missing or ill-typed."""
    if not isinstance(doc, dict):
        raise TypeError("metadata is not a JSON object")
    strs = {name: doc[name] for name in _STR_FIELDS}
    ints = {name: doc[name] for name in _INT_FIELDS}
    shape = doc["shape"]
    checksum = doc["checksum"]
    if not all(isinstance(v, str) for v in strs.values()):
        raise TypeError("a string field has another type")
    if not all(type(v) is int and v >= 0 for v in ints.values()):
        raise TypeError("an integer field is not a non-negative integer")
    if not isinstance(shape, list) or not all(type(d) is int for d in shape):
        raise TypeError("shape is not a list of integers")
    if not isinstance(checksum, str) or len(checksum) != 16:
        raise TypeError("checksum is not 16 hex digits")
    durable = doc.get("durable", False)
    if type(durable) is not bool:
        raise TypeError("durable is not a boolean")
    parent = check_parent_field(doc.get("parent_context_id", ""), doc["context_id"], doc["key"])
    for name in _SHARED_FIELDS:  # one string for all objects, not one each (issue 42)
        strs[name] = sys.intern(strs[name])
    return ObjectMeta(
        shape=tuple(shape), kept_indices=kept, checksum=int(checksum, 16), durable=durable,
        parent_context_id=parent, position=check_position_field(doc.get("position")),
        **strs, **ints,
    )  # fmt: skip
