"""Array storage of the contexts a placer knows: one slot per context.

Per slot: variant sizes ``(V,)`` and utilities ``(V, T)`` (padding: size 0, utility ``-inf``),
the utility of dropping, pinned, and the current choice — variant index and tier index (``-1``
= dropped) — plus bookkeeping for the greedy's lazy heaps (version, queued). Context ids map to
slots through ``index``; freed slots are reused.

Rows are ragged. A context of one variant (stored as it came, without a chunk layout: 9 in 10
of issue 42's bench_scale) keeps its size and utilities in ``size1`` / ``util1``; a wider one
keeps its row in ``wsize`` / ``wutil``, as wide as the widest grid, at the row ``wide_at``
names (``-1``: none). Rows all as wide as the widest grid took 744 bytes a context for 31
variants where one variant needs 24. Read a slot's row with :meth:`Slots.row`, several with
:meth:`Slots.gather`.

After :meth:`Slots.from_table` of a table whose every context is wide, the wide arrays are the
table's own (no copy): a rebalance of 100,000 contexts of 60 variants installs its result in
milliseconds. The first write into a shared array copies it (:meth:`Slots._own`), so a
caller's table is never modified.
"""

from __future__ import annotations

import functools

import numpy as np

from kvtierd.policies.model import BoolArray, FloatArray, IntArray, UtilityTable
from kvtierd.rows import grown_capacity, shared_row


class Slots:
    """Context slots backed by numpy arrays (see the module doc)."""

    def __init__(self, n_tiers: int, n_var: int = 1, capacity: int = 16) -> None:
        self.n_tiers = n_tiers
        self.index: dict[str, int] = {}
        self.keys: list[str] = [""] * capacity
        self.names: list[tuple[str, ...]] = [()] * capacity
        self.size1: FloatArray = np.zeros(capacity)
        self.util1: FloatArray = np.full((capacity, n_tiers), -np.inf)
        self.wide_at: IntArray = np.full(capacity, -1, dtype=np.int64)
        self.wsize: FloatArray = np.zeros((0, max(1, n_var)))
        self.wutil: FloatArray = np.full((0, max(1, n_var), n_tiers), -np.inf)
        self.drop: FloatArray = np.zeros(capacity)
        self.freq: FloatArray = np.zeros(capacity)
        self.pinned: BoolArray = np.zeros(capacity, dtype=bool)
        self.variant: IntArray = np.zeros(capacity, dtype=np.int64)
        self.tier: IntArray = np.full(capacity, -1, dtype=np.int64)
        self.version: IntArray = np.zeros(capacity, dtype=np.int64)
        self.queued: BoolArray = np.zeros(capacity, dtype=bool)
        self.alive: BoolArray = np.zeros(capacity, dtype=bool)
        self._free: list[int] = []  # released slots, taken again first (the last first)
        self._fresh = 0  # slots from here on were never taken (no list of a million ints)
        self._wide_free: list[int] = []  # rows of the wide arrays no slot holds
        self._shared = False

    @property
    def capacity(self) -> int:
        return self.size1.shape[0]

    @classmethod
    def from_table(cls, table: UtilityTable, variant: IntArray, tier: IntArray) -> Slots:
        """Every context of ``table`` at ``(variant, tier)``; the big arrays are shared when
        every context is wide, else the wide rows are copied (one-variant rows take 24
        bytes, not a padded row)."""
        n = table.n_contexts
        s = cls(table.n_tiers, table.size_bytes.shape[1], capacity=0)
        s.index = dict(zip(table.context_ids, range(n), strict=True))
        if len(s.index) != n:
            raise ValueError("context ids in a rebalance must be unique")
        s.keys = list(table.context_ids)
        s.names = list(table.variant_names)
        wide = np.fromiter((len(v) > 1 for v in table.variant_names), bool, n)
        many = np.flatnonzero(wide)
        s.size1 = np.where(wide, 0.0, table.size_bytes[:, 0])
        s.util1 = np.where(wide[:, None], -np.inf, table.util[:, 0, :])
        s.wide_at = np.full(n, -1, dtype=np.int64)
        s.wide_at[many] = np.arange(many.size)
        if many.size == n:
            s.wsize, s.wutil = table.size_bytes, table.util
        else:
            s.wsize, s.wutil = table.size_bytes[many], table.util[many]
        s.drop = table.drop_util
        s.freq, s.pinned = table.frequency, table.pinned
        s.variant = np.asarray(variant, dtype=np.int64).copy()
        s.tier = np.asarray(tier, dtype=np.int64).copy()
        s.version = np.zeros(n, dtype=np.int64)
        s.queued = np.zeros(n, dtype=bool)
        s.alive = np.ones(n, dtype=bool)
        s._free, s._fresh = [], n
        s._shared = True
        return s

    # -- reading rows ------------------------------------------------------------------------

    def row(self, slot: int) -> tuple[FloatArray, FloatArray]:
        """A slot's sizes ``(k,)`` and utilities ``(k, T)``: one column for a one-variant
        slot, else the wide row (padded: size 0, utility ``-inf``)."""
        w = int(self.wide_at[slot])
        if w < 0:
            return self.size1[slot : slot + 1], self.util1[slot : slot + 1]
        return self.wsize[w], self.wutil[w]

    def gather(self, slots: IntArray) -> tuple[FloatArray, FloatArray]:
        """The rows of ``slots`` as dense arrays ``(m, W)`` and ``(m, W, T)`` (padded), ``W``
        the widest of them."""
        w = self.wide_at[slots]
        many = np.flatnonzero(w >= 0)
        width = self.wsize.shape[1] if many.size else 1
        size = np.zeros((slots.size, width))
        util = np.full((slots.size, width, self.n_tiers), -np.inf)
        one = np.flatnonzero(w < 0)
        size[one, 0] = self.size1[slots[one]]
        util[one, 0] = self.util1[slots[one]]
        if many.size:
            size[many] = self.wsize[w[many]]
            util[many] = self.wutil[w[many]]
        return size, util

    def size_of(self, slot: int, variant: int) -> float:
        w = int(self.wide_at[slot])
        return float(self.size1[slot] if w < 0 else self.wsize[w, variant])

    def chosen(self, slots: IntArray) -> tuple[FloatArray, FloatArray]:
        """Size and utility of each slot's current variant in its tier (its first tier when
        dropped: the caller masks those)."""
        v, t = self.variant[slots], np.maximum(self.tier[slots], 0)
        size, util = self.size1[slots].copy(), self.util1[slots, t]
        w = self.wide_at[slots]
        many = np.flatnonzero(w >= 0)
        size[many] = self.wsize[w[many], v[many]]
        util[many] = self.wutil[w[many], v[many], t[many]]
        return size, util

    # -- changing slots ----------------------------------------------------------------------

    def add(self, key: str, names: tuple[str, ...], table: UtilityTable, row: int) -> int:
        """Store row ``row`` of ``table`` under ``key`` (dropped for now); returns its slot."""
        if key in self.index:
            raise ValueError(f"context {key!r} already has a slot")
        n_var = table.size_bytes.shape[1]
        self._own(n_var)
        if self._free:
            slot = self._free.pop()
        else:
            if self._fresh == self.capacity:
                self._grow(grown_capacity(self.capacity), self.wsize.shape[1])
            slot, self._fresh = shared_row(self._fresh), self._fresh + 1
        self.index[key] = slot
        self.keys[slot], self.names[slot] = key, shared_names(names)
        if len(names) <= 1:
            self._narrow(slot)
            self.size1[slot] = table.size_bytes[row, 0]
            self.util1[slot] = table.util[row, 0]
        else:
            w = self._widen(slot)
            self.wsize[w] = 0.0
            self.wsize[w, :n_var] = table.size_bytes[row]
            self.wutil[w] = -np.inf
            self.wutil[w, :n_var] = table.util[row]
        self.drop[slot] = table.drop_util[row]
        self.freq[slot] = table.frequency[row]
        self.pinned[slot] = table.pinned[row]
        self.variant[slot], self.tier[slot] = 0, -1
        self.queued[slot], self.alive[slot] = False, True
        return slot

    def release(self, key: str) -> None:
        """Free ``key``'s slot (the caller has already taken it out of the tiers)."""
        slot = self.index.pop(key)
        self.alive[slot] = False
        self.tier[slot] = -1
        self.keys[slot], self.names[slot] = "", ()
        self._narrow(slot)
        self._free.append(slot)

    def rescale(self, slot: int, frequency: float) -> bool:
        """Set a slot's access frequency: utilities scale with it (§4.2). False if unknown
        (a frequency of 0 leaves utilities of 0, from which the per-access part cannot be
        recovered)."""
        old = float(self.freq[slot])
        if old <= 0.0 or frequency <= 0.0:
            return False
        self._own(1)
        w = int(self.wide_at[slot])
        if w < 0:
            self.util1[slot] *= frequency / old
        else:
            self.wutil[w] *= frequency / old
        self.drop[slot] *= frequency / old
        self.freq[slot] = frequency
        return True

    # -- storage -----------------------------------------------------------------------------

    def _narrow(self, slot: int) -> None:
        """The slot keeps no wide row (one variant, or freed)."""
        w = int(self.wide_at[slot])
        if w >= 0:
            self._wide_free.append(w)
            self.wide_at[slot] = -1

    def _widen(self, slot: int) -> int:
        """The slot's wide row, taken when it has none."""
        w = int(self.wide_at[slot])
        if w >= 0:
            return w
        if not self._wide_free:
            old = self.wsize.shape[0]
            self._grow_wide(grown_capacity(old), self.wsize.shape[1])
            self._wide_free.extend(range(self.wsize.shape[0] - 1, old - 1, -1))
        w = self._wide_free.pop()
        self.wide_at[slot] = w
        return w

    def _own(self, n_var: int) -> None:
        """Copy shared arrays before the first write; widen the variant axis to ``n_var``."""
        if self._shared or n_var > self.wsize.shape[1]:
            self._grow(self.capacity, max(n_var, self.wsize.shape[1]))

    def _grow(self, capacity: int, n_var: int) -> None:
        old = self.capacity
        extra = capacity - old
        self._grow_wide(self.wsize.shape[0], n_var)
        # Rows past ``old`` are left unwritten (``add`` sets a slot's row): a large array's
        # pages untouched are not resident (a fifth of them wait for contexts after a growth).
        util1 = np.empty((capacity, self.n_tiers))
        util1[:old] = self.util1
        self.util1 = util1
        self.size1 = np.concatenate([self.size1, np.zeros(extra)])
        self.wide_at = np.concatenate([self.wide_at, np.full(extra, -1, dtype=np.int64)])
        self.drop = np.concatenate([self.drop, np.zeros(extra)])
        self.freq = np.concatenate([self.freq, np.zeros(extra)])
        self.pinned = np.concatenate([self.pinned, np.zeros(extra, dtype=bool)])
        self.variant = np.concatenate([self.variant, np.zeros(extra, dtype=np.int64)])
        self.tier = np.concatenate([self.tier, np.full(extra, -1, dtype=np.int64)])
        self.version = np.concatenate([self.version, np.zeros(extra, dtype=np.int64)])
        self.queued = np.concatenate([self.queued, np.zeros(extra, dtype=bool)])
        self.alive = np.concatenate([self.alive, np.zeros(extra, dtype=bool)])
        self.keys.extend([""] * extra)
        self.names.extend([()] * extra)
        self._shared = False

    def _grow_wide(self, rows: int, n_var: int) -> None:
        """Wide arrays of ``rows`` rows and ``n_var`` variants (a copy: never the table's)."""
        old, old_var = self.wsize.shape
        size = np.zeros((rows, n_var))
        size[:old, :old_var] = self.wsize
        util = np.empty((rows, n_var, self.n_tiers))  # rows past ``old``: set when taken
        util[:old, :old_var] = self.wutil
        util[:old, old_var:] = -np.inf
        self.wsize, self.wutil = size, util


@functools.lru_cache(maxsize=4096)
def shared_names(names: tuple[str, ...]) -> tuple[str, ...]:
    """One tuple for equal variant names: an insert's table makes its own for the one context
    it describes, and most contexts share a grid (issue 42: 49 bytes a one-variant context)."""
    return names
