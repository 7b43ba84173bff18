"""A best-fit free-list allocator over one contiguous address range (the arena, a GPU pool).

Blocks are aligned to ``alignment`` bytes (4096: page size, which O_DIRECT also needs) and
rounded up to it. Free blocks are kept twice — by offset (to coalesce neighbours on free) and
by (size, offset) (best fit, lowest address on ties) — so allocate and free are a bisect plus
a list insert. Fragmentation is reported as ``1 - largest_free / total_free``.

A pool that can refuse a request for want of one contiguous block while its free bytes would
hold it (issue 40.9: the placer counts bytes) is :meth:`~FreeListAllocator.compact`-ed: the
blocks its owner says may move slide down to the lowest free offsets, and the owner copies
their bytes as the returned :class:`Move` s say (``PooledTier.allocate``).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from kvtierd.errors import CapacityError, InvalidArgumentError


@dataclass(frozen=True, slots=True)
class Block:
    """An allocated range: ``offset`` and ``length`` (requested) within ``padded`` bytes."""

    offset: int
    length: int
    padded: int


@dataclass(frozen=True, slots=True)
class Move:
    """A block's bytes go from ``old`` to ``new`` (a lower offset; the two may overlap, so
    the copy must behave as ``memmove``)."""

    old: Block
    new: Block


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
        offset = self._by_size[i][1]
        self._take(offset, padded)
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

    def compact(
        self, movable: Iterable[Block], nbytes: int, budget_bytes: int | None = None
    ) -> list[Move]:
        """Slide ``movable`` blocks (allocated, each once) down until a block of ``nbytes``
        is free, or the bytes moved pass ``budget_bytes``; returns the moves in the order
        their bytes must be copied.

        Blocks are taken by ascending offset; each is freed (joining the free space around
        it) and allocated again at the lowest free offset that holds it, which is never above
        where it was. Every destination is free when its move is made in order: free before,
        vacated by an earlier move, or the block's own old range (an overlap). Blocks not in
        ``movable`` (leased in place, in flight) stay and the slide fills the holes below
        them with later blocks that fit. Stops as soon as a block of ``nbytes`` is free (a
        compaction copies no more than it must); returns what it moved even when that
        is not enough (blocks that may not move are in the way). The free space scanned for
        each block is the holes below it, which after the slide are only those beside
        blocks that stay: O(blocks x pinned) on a pool that is compacted once.
        """
        padded = self.round_up(nbytes)
        moves: list[Move] = []
        moved = 0
        for block in sorted(movable, key=lambda b: b.offset):
            if self.largest_free_bytes >= padded:
                break
            if budget_bytes is not None and moved > budget_bytes:
                break
            self.free(block)
            offset = next(o for o in self._by_offset if self._size_at[o] >= block.padded)
            self._take(offset, block.padded)
            if offset != block.offset:
                moves.append(Move(block, Block(offset, block.length, block.padded)))
                moved += block.length
        return moves

    def _take(self, offset: int, padded: int) -> None:
        """Allocate ``padded`` bytes at the start of the free block at ``offset``."""
        size = self._size_at[offset]
        self._remove_free(offset, size)
        if size > padded:
            self._add_free(offset + padded, size - padded)
        self.allocated_bytes += padded

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
