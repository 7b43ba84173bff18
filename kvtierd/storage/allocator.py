"""A best-fit free-list allocator over one contiguous address range (the arena, a GPU pool).

Blocks are aligned to ``alignment`` bytes (4096: page size, which O_DIRECT also needs) and
rounded up to it. Free blocks are kept twice — by offset (to coalesce neighbours on free) and
by (size, offset) (best fit, lowest address on ties) — so allocate and free are a bisect plus
a list insert. Fragmentation is reported as ``1 - largest_free / total_free``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from kvtierd.errors import CapacityError, InvalidArgumentError


@dataclass(frozen=True, slots=True)
class Block:
    """An allocated range: ``offset`` and ``length`` (requested) within ``padded`` bytes."""

    offset: int
    length: int
    padded: int


class FreeListAllocator:
    def __init__(self, size_bytes: int, alignment: int = 4096) -> None:
        if size_bytes <= 0 or alignment <= 0 or alignment & (alignment - 1):
            raise InvalidArgumentError(
                f"allocator needs size > 0 and a power-of-two alignment, got {size_bytes}, "
                f"{alignment}"
            )
        self.alignment = alignment
        self.size_bytes = size_bytes - size_bytes % alignment
        self._by_offset: list[int] = [0]
        self._size_at: dict[int, int] = {0: self.size_bytes}
        self._by_size: list[tuple[int, int]] = [(self.size_bytes, 0)]
        self.allocated_bytes = 0

    def round_up(self, nbytes: int) -> int:
        a = self.alignment
        return max(a, (nbytes + a - 1) // a * a)

    def allocate(self, nbytes: int) -> Block:
        if nbytes < 0:
            raise InvalidArgumentError(f"cannot allocate a negative size ({nbytes})")
        padded = self.round_up(nbytes)
        i = bisect.bisect_left(self._by_size, (padded, -1))
        if i == len(self._by_size):
            raise CapacityError(
                f"no free block of {padded} bytes (free {self.free_bytes} bytes in "
                f"{len(self._by_size)} blocks, largest {self.largest_free_bytes})"
            )
        size, offset = self._by_size[i]
        self._remove_free(offset, size)
        if size > padded:
            self._add_free(offset + padded, size - padded)
        self.allocated_bytes += padded
        return Block(offset, nbytes, padded)

    def free(self, block: Block) -> None:
        offset, size = block.offset, block.padded
        # Coalesce with the free neighbours on both sides.
        j = bisect.bisect_left(self._by_offset, offset)
        if j < len(self._by_offset) and self._by_offset[j] == offset:
            raise InvalidArgumentError(f"double free of block at offset {offset}")
        if j < len(self._by_offset) and self._by_offset[j] < offset + size:
            raise InvalidArgumentError(f"free of block at {offset} overlaps a free block")
        if j < len(self._by_offset) and self._by_offset[j] == offset + size:
            nxt = self._by_offset[j]
            nsize = self._size_at[nxt]
            self._remove_free(nxt, nsize)
            size += nsize
        if j > 0:
            prev = self._by_offset[j - 1]
            psize = self._size_at[prev]
            if prev + psize == offset:
                self._remove_free(prev, psize)
                offset, size = prev, size + psize
        self._add_free(offset, size)
        self.allocated_bytes -= block.padded

    @property
    def free_bytes(self) -> int:
        return self.size_bytes - self.allocated_bytes

    @property
    def largest_free_bytes(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def fragmentation(self) -> float:
        free = self.free_bytes
        return 0.0 if free == 0 else 1.0 - self.largest_free_bytes / free

    def _add_free(self, offset: int, size: int) -> None:
        bisect.insort(self._by_offset, offset)
        self._size_at[offset] = size
        bisect.insort(self._by_size, (size, offset))

    def _remove_free(self, offset: int, size: int) -> None:
        del self._by_offset[bisect.bisect_left(self._by_offset, offset)]
        del self._size_at[offset]
        del self._by_size[bisect.bisect_left(self._by_size, (size, offset))]
