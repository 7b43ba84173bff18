"""The remote tier's asynchronous half: reads and deletes through the asyncio cluster client.

A read is two round trips to one node: GET the header, then pipelined GETs of the parts,
copied into the caller's buffer and hashed on the way. Deletes are compare-and-delete scripts on
the header as read, so a newer object written meanwhile is never removed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import xxhash

from kvtierd.errors import CorruptObjectError, InvalidArgumentError, NotFoundError
from kvtierd.storage.remote_format import (
    DROP_SCRIPT,
    RELABEL_SCRIPT,
    ObjectHeader,
    ObjectKeys,
    RemoteOptions,
    as_bytes,
)
from kvtierd.types import ObjectMeta

if TYPE_CHECKING:
    import redis.asyncio.cluster as aio_cluster


class ObjectReader:
    """Reads, verifies and drops objects. Redis errors propagate (the tier maps them);
    ``NotFoundError`` / ``CorruptObjectError`` are raised after cleaning up in Redis."""

    def __init__(self, name: str, client: aio_cluster.RedisCluster, opts: RemoteOptions) -> None:
        self.name = name
        self.client = client
        self.opts = opts

    async def header(self, name: str) -> bytes | None:
        return as_bytes(await self.client.get(name))

    async def read(self, keys: ObjectKeys, key: str, tenant: str, out: memoryview) -> ObjectMeta:
        """Copy the object into ``out`` and verify its xxh3_64.

        A missing or short part is a miss (``NotFoundError``, object dropped); a long part, a
        checksum mismatch or an unreadable header is ``CorruptObjectError`` (object dropped).
        """
        raw = await self.header(keys.header)
        if raw is None:
            raise NotFoundError(f"remote tier {self.name}: no object {key!r}")
        try:
            header = ObjectHeader.decode(raw)
        except CorruptObjectError as e:
            await self.drop(keys, raw)
            raise CorruptObjectError(f"{e}; object {key!r} deleted") from e
        if header.meta.key != key or header.meta.tenant != tenant:  # xxh3_128 collision
            raise NotFoundError(f"remote tier {self.name}: no object {key!r}")
        size, part_bytes = header.meta.size_bytes, header.part_bytes
        if len(out) < size:
            raise InvalidArgumentError(f"destination holds {len(out)} bytes, object is {size}")
        names = keys.parts(header.generation, header.parts)
        hasher = xxhash.xxh3_64()
        batch = max(1, self.opts.pipeline_bytes // part_bytes)
        for first in range(0, len(names), batch):
            pipe = self.client.pipeline(transaction=False)
            for name in names[first : first + batch]:
                pipe.get(name)
            for i, value in enumerate(await pipe.execute(), start=first):
                expected = min(part_bytes, size - i * part_bytes)
                if value is None or len(value) < expected:  # evicted, expired or cut short
                    await self.drop(keys, raw)
                    raise NotFoundError(f"remote tier {self.name}: {key!r} is incomplete")
                if len(value) > expected:
                    await self.drop(keys, raw)
                    raise CorruptObjectError(f"remote tier {self.name}: {key!r}: part {i} too long")
                out[i * part_bytes : i * part_bytes + expected] = value
                hasher.update(value)
        if hasher.intdigest() != header.meta.checksum:
            await self.drop(keys, raw)
            raise CorruptObjectError(
                f"remote tier {self.name}: {key!r}: checksum mismatch; object deleted"
            )
        return header.meta

    async def relabel(self, keys: ObjectKeys, raw: bytes, new: bytes) -> bool:
        """Set the header ``new`` in place of ``raw`` (False: it changed since it was read)."""
        return bool(await self.client.eval(RELABEL_SCRIPT, 1, keys.header, raw, new))

    async def drop(self, keys: ObjectKeys, raw: bytes) -> bool:
        """Compare-and-delete the header ``raw`` and its parts (the header alone when it is
        unreadable: its parts then expire by TTL, or stay as unreachable garbage without one).
        Returns False when the header was no longer ``raw``."""
        try:
            header = ObjectHeader.decode(raw)
            names = keys.parts(header.generation, header.parts)
        except CorruptObjectError:
            names = []
        result = await self.client.eval(DROP_SCRIPT, 1 + len(names), keys.header, *names, raw)
        return bool(result)
