"""Array storage of the contexts a placer knows: one slot (row) per context.

Per slot: variant sizes ``(V,)`` and utilities ``(V, T)`` (padding: size 0, utility ``-inf``),
the utility of dropping, pinned, and the current choice — variant index and tier index (``-1``
= dropped) — plus bookkeeping for the greedy's lazy heaps (version, queued). Context ids map to
slots through ``index``; freed slots are reused.

After :meth:`Slots.from_table` the arrays are the table's own (no copy): a rebalance of 100,000
contexts installs its result in milliseconds. The first write into a shared array copies it
(:meth:`Slots._own`), so a caller's table is never modified.
"""

from __future__ import annotations

import numpy as np

from kvtierd.policies.model import BoolArray, FloatArray, IntArray, UtilityTable


class Slots:
    """Context slots backed by numpy arrays (see the module doc)."""

    def __init__(self, n_tiers: int, n_var: int = 1, capacity: int = 16) -> None:
        self.n_tiers = n_tiers
        self.index: dict[str, int] = {}
        self.keys: list[str] = [""] * capacity
        self.names: list[tuple[str, ...]] = [()] * capacity
        self.size: FloatArray = np.zeros((capacity, n_var))
        self.util: FloatArray = np.full((capacity, n_var, n_tiers), -np.inf)
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
        self._shared = False

    @classmethod
    def from_table(cls, table: UtilityTable, variant: IntArray, tier: IntArray) -> Slots:
        """Every context of ``table`` at ``(variant, tier)``; the big arrays are shared."""
        n = table.n_contexts
        s = cls(table.n_tiers, table.size_bytes.shape[1], capacity=0)
        s.index = dict(zip(table.context_ids, range(n), strict=True))
        if len(s.index) != n:
            raise ValueError("context ids in a rebalance must be unique")
        s.keys = list(table.context_ids)
        s.names = list(table.variant_names)
        s.size, s.util, s.drop = table.size_bytes, table.util, table.drop_util
        s.freq, s.pinned = table.frequency, table.pinned
        s.variant = np.asarray(variant, dtype=np.int64).copy()
        s.tier = np.asarray(tier, dtype=np.int64).copy()
        s.version = np.zeros(n, dtype=np.int64)
        s.queued = np.zeros(n, dtype=bool)
        s.alive = np.ones(n, dtype=bool)
        s._free, s._fresh = [], n
        s._shared = True
        return s

    def add(self, key: str, names: tuple[str, ...], table: UtilityTable, row: int) -> int:
        """Store row ``row`` of ``table`` under ``key`` (dropped for now); returns its slot."""
        if key in self.index:
            raise ValueError(f"context {key!r} already has a slot")
        n_var = table.size_bytes.shape[1]
        self._own(n_var)
        if self._free:
            slot = self._free.pop()
        else:
            if self._fresh == self.size.shape[0]:
                self._grow(max(16, 2 * self.size.shape[0]), self.size.shape[1])
            slot, self._fresh = self._fresh, self._fresh + 1
        self.index[key] = slot
        self.keys[slot], self.names[slot] = key, names
        self.size[slot] = 0.0
        self.size[slot, :n_var] = table.size_bytes[row]
        self.util[slot] = -np.inf
        self.util[slot, :n_var] = table.util[row]
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
        self._free.append(slot)

    def rescale(self, slot: int, frequency: float) -> bool:
        """Set a slot's access frequency: utilities scale with it (§4.2). False if unknown
        (a frequency of 0 leaves utilities of 0, from which the per-access part cannot be
        recovered)."""
        old = float(self.freq[slot])
        if old <= 0.0 or frequency <= 0.0:
            return False
        self._own(self.size.shape[1])
        self.util[slot] *= frequency / old
        self.drop[slot] *= frequency / old
        self.freq[slot] = frequency
        return True

    def _own(self, n_var: int) -> None:
        """Copy shared arrays before the first write; widen the variant axis to ``n_var``."""
        if self._shared or n_var > self.size.shape[1]:
            self._grow(self.size.shape[0], max(n_var, self.size.shape[1]))

    def _grow(self, capacity: int, n_var: int) -> None:
        old, old_var = self.size.shape
        extra = capacity - old
        size = np.zeros((capacity, n_var))
        size[:old, :old_var] = self.size
        # Rows past ``old`` are left unwritten (``add`` sets a slot's row): a large array's
        # pages untouched are not resident, and half of them wait for contexts after a growth
        # (issue 42: ~250 B an object at 1M contexts of a 30-variant grid).
        util = np.empty((capacity, n_var, self.n_tiers))
        util[:old, :old_var] = self.util
        util[:old, old_var:] = -np.inf
        self.size, self.util = size, util
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
