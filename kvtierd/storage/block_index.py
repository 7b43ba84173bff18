"""The index of a tier whose objects are blocks of one allocator (the CPU arena, the GPU pool):
key -> (meta, block), with the bytes it holds."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvtierd.errors import AlreadyExistsError, NotFoundError
from kvtierd.storage.allocator import Block
from kvtierd.types import ObjectMeta


@dataclass(frozen=True, slots=True)
class Stored:
    meta: ObjectMeta
    block: Block


class BlockIndex:
    def __init__(self, tier_name: str) -> None:
        self.tier_name = tier_name
        self._objects: dict[str, Stored] = {}
        self.used_bytes = 0
        self.block_bytes = 0  # the objects' blocks: their bytes rounded up to the alignment

    def add(self, meta: ObjectMeta, block: Block) -> None:
        if meta.key in self._objects:
            raise AlreadyExistsError(f"object {meta.key!r} is already in tier {self.tier_name!r}")
        self._objects[meta.key] = Stored(meta, block)
        self.used_bytes += meta.size_bytes
        self.block_bytes += block.padded

    def check_absent(self, key: str) -> None:
        if key in self._objects:
            raise AlreadyExistsError(f"object {key!r} is already in tier {self.tier_name!r}")

    def get(self, key: str) -> Stored:
        try:
            return self._objects[key]
        except KeyError:
            raise NotFoundError(f"object {key!r} is not in tier {self.tier_name!r}") from None

    def pop(self, key: str) -> Stored:
        stored = self.get(key)
        del self._objects[key]
        self.used_bytes -= stored.meta.size_bytes
        self.block_bytes -= stored.block.padded
        return stored

    def blocks(self) -> Iterator[tuple[str, Block]]:
        """Every object's key and block (a snapshot)."""
        return ((k, s.block) for k, s in list(self._objects.items()))

    def relocate(self, key: str, block: Block) -> None:
        """The object's bytes now live in ``block`` (a compaction moved them)."""
        stored = self.get(key)
        if block.length != stored.block.length:
            raise ValueError(f"object {key!r}: a block of {block.length} bytes for {stored.block}")
        self._objects[key] = Stored(stored.meta, block)
        self.block_bytes += block.padded - stored.block.padded

    def metas(self) -> Iterator[ObjectMeta]:
        return (s.meta for s in list(self._objects.values()))

    def clear(self) -> None:
        self._objects.clear()
        self.used_bytes = 0
        self.block_bytes = 0

    def __len__(self) -> int:
        return len(self._objects)
