"""Tiers whose objects are blocks of one memory pool the daemon maps: the CPU tier's arena and
a gpu tier's CUDA pool. A reader can be leased such a block in place; when the object is moved
or deleted under a lease, the engine detaches the block from the index and frees it only after
the last release.

**Room the placer counted is room** (issue 40.9). The placer counts a tier's bytes; a pool
carved by a best-fit allocator fragments, and refused ``no free block of 16777216 bytes (free
16777216 bytes in 2 blocks, largest 14674688)`` while the placer believed the context placed.
An allocation that fails while the pool's free bytes would hold it compacts the pool
(:meth:`PooledTier.allocate`): the index's objects slide down to the lowest free offsets
(``FreeListAllocator.compact``) and their bytes are copied there (a ``memmove`` in the arena,
a device-to-device copy in the GPU pool). What must not move stays, and the slide fills the
holes below it:

* an object leased in place — a client reads it at its offset (the engine's lease table says
  which: :meth:`check_leases_with`);
* an object whose bytes a copy on a worker thread reads (:meth:`pinned`);
* every block that is no index object: a put in flight (a client writes it at its offset), a
  block detached under a lease, a copy staged for a reader.

Size classes (pages of the chunk size) were the other way: they waste the tail of every
object that is not a whole number of pages (a compressed variant, a model card, the last
chunk), and the daemon does not know the chunk size before the first put. A compaction runs
only when an allocation would otherwise fail, copies no more than it needs to free one block
of half the pool's free bytes (or the one asked for, if larger: so that the allocations after
it find room without compacting again), and is synchronous (no other coroutine sees a
half-moved pool; in the GPU pool it runs under the lock every copy takes). A place that fails
all the same (the objects in the way are leased) is adopted where the context is
(``Executor._learn_where_it_is``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from abc import abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator

from kvtierd.config import TierConfig
from kvtierd.errors import CapacityError
from kvtierd.storage.allocator import Block, FreeListAllocator, Move
from kvtierd.storage.base import Tier
from kvtierd.storage.block_index import BlockIndex

logger = logging.getLogger(__name__)

MOVED_PER_FREED = 16  # at most this many bytes moved by a compaction per byte it frees
COMPACTION_LOG_S = 60.0  # at most one INFO line about compactions in this many seconds


def _nothing_leased(offset: int) -> bool:
    return False


class PooledTier(Tier):
    def __init__(self, config: TierConfig) -> None:
        super().__init__(config)
        self._index = BlockIndex(self.name)
        self._pins: Counter[int] = Counter()  # offset -> copies reading that block
        self._leased: Callable[[int], bool] = _nothing_leased
        self.compacted_bytes = 0  # moved by compactions since start
        self._compactions = 0  # since the last INFO line about them
        self._compaction_logged_at = -COMPACTION_LOG_S

    def rounding_bytes(self) -> int:
        """What the objects' blocks take beyond their bytes (each is rounded up to the
        allocator's 4 KiB alignment): room the tier's capacity, counted in object bytes, does
        not show (``Placer.hold_back``)."""
        return self._index.block_bytes - self._index.used_bytes

    @abstractmethod
    def block_of(self, key: str) -> Block:
        """The block holding an object's bytes."""

    @abstractmethod
    def detach(self, key: str) -> Block:
        """Forget the object but keep its block (freed later by :meth:`free_block`)."""

    @abstractmethod
    def free_block(self, block: Block) -> None:
        """Return a detached block to the pool."""

    @abstractmethod
    def _move_bytes(self, move: Move) -> None:
        """Copy a block's bytes to a lower offset of the pool (ranges may overlap)."""

    def check_leases_with(self, leased: Callable[[int], bool]) -> None:
        """``leased(offset)``: a reader holds the block at ``offset`` in place (it never
        moves); the engine's lease table answers."""
        self._leased = leased

    @contextlib.contextmanager
    def pinned(self, key: str) -> Iterator[Block]:
        """The object's block, kept where it is while the caller reads it across awaits (a
        copy to another tier on a worker thread)."""
        block = self.block_of(key)
        self._pins[block.offset] += 1
        try:
            yield block
        finally:
            self._pins[block.offset] -= 1
            if not self._pins[block.offset]:
                del self._pins[block.offset]

    def allocate(self, allocator: FreeListAllocator, nbytes: int, least_freed: int = 0) -> Block:
        """A block of ``nbytes`` from ``allocator`` (this tier's pool), compacting the pool
        when its free bytes would hold one but no free block does (module docstring). Raises
        ``CapacityError`` when the bytes are not free, when what may not move is in the way,
        or when a compaction could not free ``least_freed`` bytes in one block (half the free
        bytes: a caller that can wait asks for a compaction only where it pays for itself)."""
        try:
            return allocator.allocate(nbytes)
        except CapacityError as e:
            if allocator.free_bytes < allocator.round_up(nbytes):
                raise
            if allocator.free_bytes // 2 < least_freed:
                raise CapacityError(
                    f"{e}: too little free to compact for ({allocator.free_bytes} bytes free, "
                    f"{least_freed * 2} wanted); retry once the daemon has moved contexts down"
                ) from e
        keys = {
            block.offset: key
            for key, block in self._index.blocks()
            if not self._pins[block.offset] and not self._leased(block.offset)
        }
        movable = [self._index.get(key).block for key in keys.values()]
        # Free more than the block asked for: a compaction is a pass over every object, and one
        # that freed just one block left the next allocation to compact again (issue 42: 100k
        # objects of 1-16 KiB, 500 compactions in 4.5 min, ~100 MB moved for each 10 KiB
        # block). Half the free bytes in one block serve many allocations before the next.
        # And not at any price: in a pool nearly full (puts outrunning the moves down) each
        # compaction moved ~100 MB for a few free KiB, again and again; past this many bytes
        # moved per byte it frees, the allocation is refused (a put answers RESOURCE_EXHAUSTED
        # and is retried; a plan's move is adopted where the context is).
        want = max(nbytes, allocator.free_bytes // 2)
        moves = allocator.compact(movable, want, budget_bytes=MOVED_PER_FREED * want)
        for move in moves:
            self._move_bytes(move)
            self._index.relocate(keys[move.old.offset], move.new)
        moved = sum(m.old.length for m in moves)
        self.compacted_bytes += moved
        self._compactions += 1
        now = time.monotonic()
        # INFO at most once a minute (the first at once), with the count since: a busy pool
        # compacts every few hundred ms (issue 42's quiet logs); each one at DEBUG.
        level = logging.DEBUG
        if moves and now - self._compaction_logged_at >= COMPACTION_LOG_S:
            level, self._compaction_logged_at = logging.INFO, now
        logger.log(level, "tier %s: compacted for a block of %d bytes: moved %d objects, %d "
                   "bytes (%d compactions since the last such line)", self.name, nbytes,
                   len(moves), moved, self._compactions)  # fmt: skip
        if level == logging.INFO:
            self._compactions = 0
        try:
            return allocator.allocate(nbytes)
        except CapacityError as e:
            if moved > MOVED_PER_FREED * want:
                raise CapacityError(
                    f"{e}: the pool is nearly full (a block of {nbytes} bytes would take moving "
                    f"more than {MOVED_PER_FREED} bytes for each byte freed); retry once the "
                    "daemon has moved contexts down"
                ) from e
            stay = len(self._index) - len(movable)
            raise CapacityError(
                f"{e}, after compacting the pool: {stay} objects leased in place or being "
                "read may not move, and blocks in flight stay"
            ) from e
