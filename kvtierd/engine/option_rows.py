"""Every context's options kept between rebalances, as rows of dense arrays (issue 28).

A rebalance tells the placer the options of every context (``context_options.py``). Worked
out afresh, that is a grid of variants to list, check for servability and size per context:
about 2 ms a context with 60 variants, 250 s for 100,000. Most of it does not change between
two rebalances, so each context keeps a row here: variant names, sizes, quality and restore
seconds, its token count and the recompute time its profile gives. A row of one variant (a
context without a chunk layout, stored as it came: 9 contexts in 10 of issue 42's bench_scale)
keeps its three numbers in ``first``; a wider one keeps its ``(3, V)`` in ``wide``, at the row
``wide_at`` names. Rows as wide as the widest grid took 744 bytes a context (31 variants) where
a one-variant row needs 24. A row is rebuilt only when what it was built from changed:

* the context itself (its form, its objects, its reference copy, its bytes: the row's stamp);
* its profile (the profiler's record of it, compared by value; a new profiler is a new epoch);
* the grid or what can be served (a new policy, a model card learnt: a new epoch, every row);
* anything else the engine knows changed it (:meth:`OptionRows.row` with ``fresh=True``, which
  ``Placing`` passes on every insert: a context whose token ids made a variant servable, say).

What moves every time — frequency, recompute time at today's prefill speed, pinning, last
access — is read live for each rebalance. :meth:`OptionRows.arrays` gathers the rows of the
contexts asked for into :class:`~kvtierd.policies.model.OptionArrays` with numpy: no Python
object per variant.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TypeVar

import numpy as np

from kvtierd.engine.context_options import UNKNOWN_PREFILL_S, ContextOptions
from kvtierd.engine.state import ContextRecord
from kvtierd.policies.model import BoolArray, FloatArray, IntArray, OptionArrays
from kvtierd.rows import grown_capacity, shared_row
from kvtierd.types import ContextProfile, VariantProfile

Stamp = tuple[object, ...]
SHARED_STAMPS = 65_536  # distinct stamps kept for sharing (the table is emptied past this)
Array = TypeVar("Array", FloatArray, IntArray)


class OptionRows:
    """The rows of the contexts ``options`` prices (see the module doc)."""

    def __init__(self, options: ContextOptions) -> None:
        self._options = options
        self._slot: dict[str, int] = {}
        self._free: list[int] = []  # released rows, taken again first (the last first)
        self._fresh = 0  # rows from here on were never taken (no list of a million ints)
        self._stamp: list[Stamp | None] = []
        # One tuple for equal stamps without a profile record: a tuple a row was 80 bytes of
        # a restart's ~1.2 KB an object (issue 42). Compared by value, never by identity.
        self._shared_stamps: dict[Stamp, Stamp] = {}
        self._names: list[tuple[str, ...]] = []
        self._interned: dict[tuple[str, ...], tuple[str, ...]] = {}
        self._epoch: tuple[object, ...] = ()
        self.first: FloatArray = np.zeros((0, 3))  # size, quality, restore of 1-variant rows
        self.wide_at: IntArray = np.zeros(0, dtype=np.int64)  # the row's in ``wide``, else -1
        self.wide: FloatArray = np.zeros((0, 3, 2))  # size, quality, restore of wider rows
        self._wide_free: list[int] = []
        self.count: IntArray = np.zeros(0, dtype=np.int64)
        self.tokens: IntArray = np.zeros(0, dtype=np.int64)
        self.profile_prefill: FloatArray = np.zeros(0)
        self.rebuilt = 0  # rows built since this object was made (tests and benchmarks read it)

    def __len__(self) -> int:
        return len(self._slot)

    @property
    def nbytes(self) -> int:
        """Bytes of the rows' variant arrays (one-variant and wide rows)."""
        return self.first.nbytes + self.wide.nbytes

    # -- one context ----------------------------------------------------------------------------

    def row(self, ctx: ContextRecord, *, fresh: bool = False) -> int:
        """The slot of the context's row, rebuilt when stale (or ``fresh`` is asked for)."""
        self._check_epoch()
        slot = self._slot.get(ctx.context_id)
        stamp = self._stamp_of(ctx)
        if fresh or slot is None or self._stamp[slot] != stamp:
            slot = self._build(ctx, stamp, slot)
        return slot

    def profile(self, ctx: ContextRecord, *, fresh: bool = False) -> ContextProfile:
        """The context's :class:`ContextProfile` from its row (the online path: one context)."""
        slot = self.row(ctx, fresh=fresh)
        k, w = int(self.count[slot]), int(self.wide_at[slot])
        columns = self.first[slot, :, None] if w < 0 else self.wide[w, :, :k]
        sizes, quality, restore = columns.tolist()
        whole = ctx.size_bytes  # its int, not one more an object (issue 42: 32 B a context)
        variants = tuple(
            VariantProfile(name, whole if size == whole else int(size), q, r)
            for name, size, q, r in zip(self._names[slot], sizes, quality, restore, strict=True)
        )
        freq = self._frequencies([ctx], time.time())
        prefill = self._prefill(np.array([slot], dtype=np.int64))
        return ContextProfile(ctx.context_id, variants, float(freq[0]), float(prefill[0]),
                              ctx.last_access_s, ctx.pinned)  # fmt: skip

    def forget(self, context_id: str) -> None:
        slot = self._slot.pop(context_id, None)
        if slot is not None:
            self._stamp[slot] = None
            self._names[slot] = ()
            self._narrow(slot)
            self._free.append(slot)

    # -- every context --------------------------------------------------------------------------

    def arrays(self, contexts: Iterable[ContextRecord]) -> OptionArrays:
        """The options of ``contexts`` as arrays (rows rebuilt where stale); rows of contexts
        no longer asked for are kept until :meth:`forget` (or :meth:`prune`)."""
        self._check_epoch()
        ctxs = list(contexts)
        stamps, slot_of, built = self._stamp, self._slot, self._build
        profiler = self._options.profiler()
        record = (lambda _: None) if profiler is None else profiler.record
        slots, ids = [], []
        for ctx in ctxs:
            cid = ctx.context_id
            ids.append(cid)
            # _stamp_of inlined: this loop is the rebalance's one pass over every context.
            stamp = (ctx.variant, len(ctx.keys), len(ctx.reference or ()), ctx.size_bytes,
                     record(cid))  # fmt: skip
            slot = slot_of.get(cid)
            if slot is None or stamps[slot] != stamp:
                slot = built(ctx, stamp, slot)
            slots.append(slot)
        at = np.array(slots, dtype=np.int64)
        width = int(self.count[at].max()) if at.size else 1
        valid: BoolArray = np.arange(width)[None, :] < self.count[at][:, None]
        names = self._names
        columns = np.zeros((3, at.size, width))  # size, quality, restore
        w = self.wide_at[at]
        one = np.flatnonzero(w < 0)
        columns[:, one, 0] = self.first[at[one]].T
        many = np.flatnonzero(w >= 0)
        columns[:, many] = self.wide[w[many], :, :width].transpose(1, 0, 2)
        return OptionArrays(
            context_ids=tuple(ids),
            variant_names=tuple(names[s] for s in slots),
            size_bytes=columns[0],
            quality=columns[1],
            restore_s=columns[2],
            valid=valid,
            frequency=self._frequencies(ctxs, time.time(), ids),
            prefill_s=self._prefill(at),
            last_access_s=np.fromiter((c.last_access_s for c in ctxs), np.float64, len(ctxs)),
            pinned=np.fromiter((c.pinned for c in ctxs), bool, len(ctxs)),
        )

    def prune(self, keep: Iterable[str]) -> int:
        """Forget the rows of contexts not in ``keep``; returns how many went."""
        kept = set(keep)
        gone = [cid for cid in self._slot if cid not in kept]
        for cid in gone:
            self.forget(cid)
        return len(gone)

    # -- internals ------------------------------------------------------------------------------

    def _stamp_of(self, ctx: ContextRecord) -> Stamp:
        """What a row was built from that belongs to the context (the rest is the epoch)."""
        profiler = self._options.profiler()
        record = None if profiler is None else profiler.record(ctx.context_id)
        return (ctx.variant, len(ctx.keys), len(ctx.reference or ()), ctx.size_bytes, record)

    def _check_epoch(self) -> None:
        """Every row goes stale with a new grid, profiler or set of model cards."""
        epoch = self._options.epoch()
        if epoch != self._epoch:
            self._epoch = epoch
            self._stamp = [None] * len(self._stamp)

    def _build(self, ctx: ContextRecord, stamp: Stamp, slot: int | None) -> int:
        row = self._options.grid_row(ctx)
        if slot is None:
            slot = self._new_slot(ctx.context_id)
        k = len(row.names)
        if k == 1:
            self._narrow(slot)
            self.first[slot] = (row.size_bytes[0], row.quality[0], row.restore_s[0])
        else:
            w = self._widen(slot, k)
            self.wide[w, :, :k] = (row.size_bytes, row.quality, row.restore_s)
            self.wide[w, :, k:] = 0.0
        self.count[slot] = k
        self.tokens[slot] = self._options.tokens_of(ctx)
        fallback = self._options.profiled_prefill_s(ctx.context_id)
        self.profile_prefill[slot] = UNKNOWN_PREFILL_S if fallback is None else fallback
        self._names[slot] = self._interned.setdefault(row.names, row.names)
        if stamp[-1] is None:  # unprofiled: contexts of one form, size and count share it
            if len(self._shared_stamps) >= SHARED_STAMPS:
                self._shared_stamps.clear()
            stamp = self._shared_stamps.setdefault(stamp, stamp)
        self._stamp[slot] = stamp
        self.rebuilt += 1
        return slot

    def _prefill(self, at: IntArray) -> FloatArray:
        """Seconds to recompute each row's context at today's prefill speed
        (``TtftModel.prefill_s``: tokens / tokens per second, the same division in numpy),
        else what its profile measured."""
        profiler = self._options.profiler()
        if profiler is None:
            return np.full(at.size, UNKNOWN_PREFILL_S)
        tokens = self.tokens[at]
        rate = profiler.ttft.prefill_tokens_per_s
        return np.where(tokens != 0, tokens / rate, self.profile_prefill[at])

    def _frequencies(
        self, ctxs: list[ContextRecord], now_s: float, ids: list[str] | None = None
    ) -> FloatArray:
        """Decayed access frequency (``ContextOptions.frequency``), else the hits counted
        (``ids``: the contexts' ids, when the caller has them)."""
        profiler = self._options.profiler()
        if profiler is None:
            return _hits(ctxs, np.ones(len(ctxs), dtype=bool))
        ids = [c.context_id for c in ctxs] if ids is None else ids
        out = profiler.frequency.frequencies(ids, now_s)
        unknown = ~(out > 0)  # never accessed (0), as ContextOptions.frequency reads it
        if unknown.any():
            out[unknown] = _hits(ctxs, unknown)
        return out

    def _new_slot(self, context_id: str) -> int:
        if self._free:
            slot = self._free.pop()
        else:
            if self._fresh == self.count.size:
                self._grow(grown_capacity(self.count.size))
            slot, self._fresh = shared_row(self._fresh), self._fresh + 1
        self._slot[context_id] = slot
        return slot

    def _grow(self, capacity: int) -> None:
        old = self.count.size
        self.first, self.count, self.tokens = (
            _more(self.first, capacity), _more(self.count, capacity), _more(self.tokens, capacity)
        )  # fmt: skip
        self.profile_prefill = _more(self.profile_prefill, capacity)
        self.wide_at = _more(self.wide_at, capacity, fill=-1)
        self._stamp += [None] * (capacity - old)
        self._names += [()] * (capacity - old)

    def _narrow(self, slot: int) -> None:
        """The slot keeps no wide row (it has one variant, or is freed)."""
        w = int(self.wide_at[slot])
        if w >= 0:
            self._wide_free.append(w)
            self.wide_at[slot] = -1

    def _widen(self, slot: int, width: int) -> int:
        """The slot's wide row, taken when it has none, with room for ``width`` variants."""
        have = self.wide.shape[2]
        if width > have:
            self.wide = np.pad(self.wide, ((0, 0), (0, 0), (0, width - have)))
        w = int(self.wide_at[slot])
        if w < 0:
            if not self._wide_free:
                old = self.wide.shape[0]
                self.wide = _more(self.wide, grown_capacity(old))
                self._wide_free.extend(range(self.wide.shape[0] - 1, old - 1, -1))
            w = self._wide_free.pop()
            self.wide_at[slot] = w
        return w


def _more(a: Array, capacity: int, fill: float = 0) -> Array:
    """``a`` with room for ``capacity`` rows, the new ones ``fill`` (zeros are left unwritten:
    pages no row has taken yet are not resident)."""
    shape = (capacity, *a.shape[1:])
    b = np.zeros(shape, dtype=a.dtype) if fill == 0 else np.full(shape, fill, dtype=a.dtype)
    b[: a.shape[0]] = a
    return b


def _hits(ctxs: list[ContextRecord], which: BoolArray) -> FloatArray:
    """``max(hits, 1)`` of the contexts ``which`` selects, as floats."""
    picked = [c.hits for c, w in zip(ctxs, which.tolist(), strict=True) if w]
    return np.maximum(np.array(picked, dtype=np.float64), 1.0)
