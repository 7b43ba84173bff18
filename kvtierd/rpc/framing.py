"""Hand-built wire frames for the data parts of PutStream/GetStream.

``PutPart(data=...)`` and ``GetPart(data=...)`` are field 2, length-delimited: on the wire a
tag byte, a varint length and the raw bytes. Building that frame directly copies a part once
(protobuf would copy it into a ``bytes`` field, then again to serialize), and parsing it
directly hands out a view of the received bytes. Frames stay valid protobuf, so any gRPC client
of the .proto reads them.
"""

from __future__ import annotations

DATA_TAG = 0x12  # field 2, wire type 2
_TAG = bytes((DATA_TAG,))


def varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def data_frame(view: memoryview) -> bytes:
    """The wire form of a data part carrying ``view`` as its ``data``: one copy."""
    return b"".join((_TAG, varint(len(view)), view))


def data_of(frame: bytes) -> memoryview | None:
    """The ``data`` of a frame made by :func:`data_frame` as a view; ``None`` for any other
    message (a header), which the caller parses with protobuf."""
    if frame[:1] != _TAG:
        return None
    length, shift, i = 0, 0, 1
    while True:
        b = frame[i]
        length |= (b & 0x7F) << shift
        i += 1
        if b < 0x80:
            break
        shift += 7
    return memoryview(frame)[i:] if i + length == len(frame) else None
