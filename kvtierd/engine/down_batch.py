"""Moves of small objects down from the CPU tier to an SSD tier, many with one sync.

Written one file and one sync at a time, moves down held a daemon that puts many small objects
to ~230 objects a second once its CPU tier was full (4.3 ms an object; issue 42's bench_scale
at 1M), while ``SsdTier.put_many`` writes them in batches of 64 at 0.41 ms an object. The plan
executor gathers the moves down of the plans queued behind each other into a
:class:`DownBatch`, and a graceful stop writes the CPU tier with one (``shutdown_flush``).

Only a move that is nothing but writes of small objects from the CPU tier is batched
(:func:`down_objects`); one with a variant's marker to place, a durable copy to drop or an
object on a third tier takes ``TierMover.move_context``'s path. A context joins a batch
charged to the target at once (a quota check of the next one counts it); its lock is taken
only when the batch is written, where it is checked again: a context that changed meanwhile
(deleted, grown, moved) leaves the batch, uncharged, for its caller to move alone.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Mapping, Sequence
from typing import Generic, NamedTuple, TypeVar

from kvtierd.engine.index import ContextIndex
from kvtierd.engine.mover import TierMover
from kvtierd.engine.state import ContextRecord, ObjectRecord
from kvtierd.errors import KvtierError
from kvtierd.storage import Tier
from kvtierd.storage.ssd import SsdTier

T = TypeVar("T")

BATCH_OBJECT_BYTES = 1 << 20  # objects up to this size go in batches; larger ones one by one
BATCH_BYTES = 16 << 20  # a batch is written when it holds this much...
BATCH_OBJECTS = 1024  # ...or this many objects


def down_target(tiers: Mapping[str, Tier]) -> SsdTier | None:
    """The tier small objects are moved down to in batches: the first of kind ``ssd``."""
    return next((t for t in tiers.values() if isinstance(t, SsdTier)), None)


def down_objects(
    index: ContextIndex, ctx: ContextRecord, cpu: str, target: str
) -> list[ObjectRecord] | None:
    """The context's objects in the CPU tier when its move to ``target`` is only writes of
    small objects from there; ``None`` when it is more: a marker to place, a durable copy
    to drop, an object on a third tier or one larger than :data:`BATCH_OBJECT_BYTES`."""
    if ctx.marker is not None:
        return None
    objs = []
    for key in ctx.keys:
        obj = index.objects.get(key)
        if obj is None:
            continue
        if obj.shadow or obj.meta.size_bytes > BATCH_OBJECT_BYTES:
            return None
        if obj.tier == cpu:
            objs.append(obj)
        elif obj.tier != target:
            return None
    return objs


class DownWrite(NamedTuple, Generic[T]):
    """What writing a batch did: the entries ``written`` and their bytes; those that
    ``changed`` since they joined (not written: their callers move them alone); and when the
    write failed (``error``), the entries that were in it (``failed``: nothing moved)."""

    written: list[T]
    changed: list[T]
    nbytes: int = 0
    failed: Sequence[T] = ()
    error: Exception | None = None


class DownBatch(Generic[T]):
    """Contexts waiting to be moved from the CPU tier to ``target`` together, each with what
    its caller wants back for it (``T``: the plan operation, or the context)."""

    def __init__(self, index: ContextIndex, mover: TierMover, target: SsdTier) -> None:
        self._index, self._mover, self.target = index, mover, target
        self._entries: dict[str, tuple[ContextRecord, list[ObjectRecord], T]] = {}
        self.nbytes = self.nobjects = 0
        self.batches = 0  # written so far

    def __contains__(self, context_id: str) -> bool:
        return context_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def full(self) -> bool:
        return self.nbytes >= BATCH_BYTES or self.nobjects >= BATCH_OBJECTS

    def add(self, ctx: ContextRecord, objs: list[ObjectRecord], what: T) -> None:
        """``ctx`` joins with ``objs`` (:func:`down_objects`), charged to the target now."""
        assert ctx.context_id not in self._entries, ctx.context_id
        for obj in objs:
            self._index.account(obj.meta, self.target.name, +1)
        self._entries[ctx.context_id] = (ctx, objs, what)
        self.nbytes += sum(o.meta.size_bytes for o in objs)
        self.nobjects += len(objs)

    async def write(self) -> DownWrite[T]:
        """Write every context still as it joined with one sync, under their locks, then drop
        their CPU copies. The batch is empty after it, whatever happens; when the write fails
        (``KvtierError``, ``OSError``: the SSD tier is full, say) nothing has moved and
        nothing stays charged."""
        entries, self._entries = list(self._entries.values()), {}
        self.nbytes = self.nobjects = 0
        written: list[tuple[ContextRecord, list[ObjectRecord], T]] = []
        changed: list[T] = []
        async with contextlib.AsyncExitStack() as locks:
            for ctx, objs, what in entries:
                await locks.enter_async_context(ctx.lock)
                if self._as_joined(ctx, objs):
                    written.append((ctx, objs, what))
                else:
                    self._uncharge(objs)
                    changed.append(what)
            objects = [o for _, objs, _ in written for o in objs]
            if not objects:
                return DownWrite([], changed, 0)
            whats = [what for _, _, what in written]
            try:
                nbytes = await self._mover.write_down(objects, self.target)
            except (KvtierError, OSError) as e:
                self._uncharge(objects)
                return DownWrite([], changed, failed=whats, error=e)
            except BaseException:
                self._uncharge(objects)
                raise
        self.batches += 1
        return DownWrite(whats, changed, nbytes)

    def _as_joined(self, ctx: ContextRecord, objs: list[ObjectRecord]) -> bool:
        if self._index.contexts.get(ctx.context_id) is not ctx:
            return False  # deleted (or deleted and put again) since it joined
        now = down_objects(self._index, ctx, self._mover.cpu.name, self.target.name)
        return now is not None and len(now) == len(objs) and all(map(operator.is_, now, objs))

    def _uncharge(self, objs: list[ObjectRecord]) -> None:
        for obj in objs:
            self._index.account(obj.meta, self.target.name, -1)
