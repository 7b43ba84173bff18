"""Incremental state of EvicPress's greedy placer (Appendix A, Algorithm 1) with lazy heaps.

Contexts live in *slots* of numpy arrays: sizes ``(S, V)``, utilities ``(S, V, T)``, and per slot
the chosen variant index and tier index (``-1`` = dropped). A full rebalance installs its whole
table and assignment in one step (:meth:`GreedyState.from_table`): no Python object per context.

Each finite tier keeps a min-heap of its contexts keyed by the *score* of their cheapest
operation that frees space in that tier: compress in place to a smaller variant, move down to any
slower tier with any variant that fits there, or drop. A context's cheapest operation depends only
on its own state, so an entry stays valid until that context changes; then its ``version`` is
bumped and a new entry pushed (lazy invalidation: stale entries are skipped when popped, and a
heap is rebuilt when more than half of it is stale). Every operation is ``O(log n)``. After a bulk
install a tier's heap is built (vectorised, one ``heapify``) the first time that tier overflows.
An entry is one int, ``score_key(score) << 96 | seq << 32 | slot``: ints order as their scores
do (:func:`score_key`), then by push number (``seq``, which breaks ties in push order). A push
makes its number the slot's version, so the entry names the slot and the version it was pushed
at. Issue 42: a heap holds an entry for each of a million contexts, and one 48-byte int an entry
is ~64 bytes a context fewer than a ``(score, key)`` tuple with its float and int.

Selection rules (``PlacerParams.selection``):

* ``per_byte`` (default): least utility drop per byte freed in the overflowing tier — the
  knapsack "efficiency" rule; it follows each context's concave hull.
* ``absolute``: least utility drop, however few bytes it frees — Algorithm 1 read literally
  ("the least utility drop operation").
"""

from __future__ import annotations

import enum
import heapq
import math
import struct
from dataclasses import dataclass

import numpy as np

from kvtierd.errors import CapacityError, InvalidArgumentError
from kvtierd.policies.model import FloatArray, IntArray, UtilityTable, capacity_array
from kvtierd.policies.slots import Slots

DROP = -1
"""Tier index of a dropped context."""
# A heap entry: its score's key above its push number (64 bits) above its slot (32 bits).
SEQ_SHIFT = 32
SLOT_MASK = (1 << SEQ_SHIFT) - 1
SCORE_SHIFT = SEQ_SHIFT + 64
SEQ_MASK = (1 << 64) - 1
_SIGN = 1 << 63
_F64, _U64 = struct.Struct("<d"), struct.Struct("<Q")


def score_key(score: float) -> int:
    """A 64-bit int that orders as ``score`` does: a float's IEEE bits, the sign bit set for
    positive ones and every bit flipped for negative ones. ``-0.0`` is keyed as ``0.0`` (they
    compare equal). NaN is never keyed (a heap holds finite scores only)."""
    bits: int = _U64.unpack(_F64.pack(score + 0.0))[0]
    return bits ^ SEQ_MASK if bits & _SIGN else bits | _SIGN


def score_keys(scores: FloatArray) -> list[int]:
    """:func:`score_key` of each score, vectorised (the same ints)."""
    bits = (scores + 0.0).view(np.uint64)
    keyed = np.where(bits & np.uint64(_SIGN), ~bits, bits | np.uint64(_SIGN))
    return keyed.tolist()  # type: ignore[no-any-return]


def key_score(entry: int) -> float:
    """The score of a heap entry (:func:`score_key` inverted)."""
    key = entry >> SCORE_SHIFT
    bits = key ^ _SIGN if key & _SIGN else key ^ SEQ_MASK
    return float(_F64.unpack(_U64.pack(bits))[0])


def entry_slot(entry: int) -> tuple[int, int]:
    """The slot of a heap entry and the version it was pushed at."""
    return entry & SLOT_MASK, entry >> SEQ_SHIFT & SEQ_MASK


class Selection(enum.Enum):
    """Which operation the greedy applies first when a tier overflows."""

    PER_BYTE = "per_byte"
    ABSOLUTE = "absolute"

    @classmethod
    def parse(cls, name: str) -> Selection:
        try:
            return cls(name)
        except ValueError:
            known = ", ".join(s.value for s in cls)
            raise InvalidArgumentError(f"unknown selection rule {name!r}; known: {known}") from None


@dataclass(frozen=True, slots=True)
class Step:
    """A change the greedy made: ``key`` went from ``(src_variant, src_tier)`` to the target.

    A tier of ``None`` is dropped.
    """

    key: str
    src_variant: int
    src_tier: int | None
    dst_variant: int
    dst_tier: int | None


class GreedyState:
    """Per-tier used bytes, context slots and lazy heaps; :meth:`resolve` is Algorithm 1's loop."""

    def __init__(self, capacities: tuple[int | None, ...], selection: Selection) -> None:
        self.capacities = capacities
        self.selection = selection
        self.caps = capacity_array(capacities)
        self._caps: list[float] = self.caps.tolist()
        self.slots = Slots(len(capacities))
        self.used = [0.0] * len(capacities)
        self.held = [0] * len(capacities)  # contexts placed in each tier
        self._heaps: list[list[int]] = [[] for _ in capacities]
        self._live = [0] * len(capacities)
        self._seq = 0
        self._unqueued: set[int] = set()

    def set_capacities(self, capacities: tuple[int | None, ...]) -> None:
        """New tier capacities (``Placer.hold_back``); :meth:`resolve` then fits them."""
        if len(capacities) != len(self.capacities):
            raise ValueError(f"{len(capacities)} capacities for {len(self.capacities)} tiers")
        self.capacities = capacities
        self.caps = capacity_array(capacities)
        self._caps = self.caps.tolist()

    @classmethod
    def from_table(
        cls,
        table: UtilityTable,
        variant: IntArray,
        tier: IntArray,
        selection: Selection,
    ) -> GreedyState:
        """A state holding every context of ``table`` at ``(variant, tier)`` (tier -1: dropped).

        The table's arrays are shared, not copied (they are copied on the first write).
        """
        state = cls(table.capacity_bytes, selection)
        state.slots = Slots.from_table(table, variant, tier)
        placed = tier >= 0
        size = table.size_bytes[np.flatnonzero(placed), variant[placed]]
        used = np.bincount(tier[placed], weights=size, minlength=table.n_tiers)
        state.used = [float(u) for u in used]
        state.held = np.bincount(tier[placed], minlength=table.n_tiers).tolist()
        state._unqueued = {t for t in range(table.n_tiers) if used[t] > 0}
        return state

    def best_start(self, size: FloatArray, util: FloatArray, drop_util: float) -> tuple[int, int]:
        """The best configuration ignoring other contexts (Algorithm 1 line 1), fastest on ties.

        Only variants that fit in the tier alone are considered; dropping (tier -1) wins when
        nothing cached beats it.
        """
        masked = np.where(size[:, None] <= self.caps[None, :], util, -np.inf)
        flat = int(np.argmax(masked.T))  # tier-major order: ties go to the faster tier
        tier, variant = divmod(flat, masked.shape[0])
        if not np.isfinite(masked[variant, tier]) or masked[variant, tier] < drop_util:
            return 0, DROP
        return variant, tier

    def add(self, key: str, names: tuple[str, ...], table: UtilityTable, row: int) -> int:
        """Give row ``row`` of ``table`` a slot, dropped; :meth:`place` then puts it somewhere."""
        return self.slots.add(key, names, table, row)

    def place(self, slot: int, variant: int, tier: int) -> None:
        """Put a (dropped) slot at ``(variant, tier)``; the caller then calls :meth:`resolve`."""
        s = self.slots
        s.variant[slot], s.tier[slot] = variant, tier
        self._bump(slot)
        if tier >= 0:
            self.used[tier] += s.size_of(slot, variant)
            self.held[tier] += 1
            self._push(slot)

    def discard(self, key: str) -> bool:
        """Forget a context; its heap entry goes stale. False if it was unknown."""
        slot = self.slots.index.get(key)
        if slot is None:
            return False
        s = self.slots
        t = int(s.tier[slot])
        if t >= 0:
            self.used[t] -= s.size_of(slot, int(s.variant[slot]))
            self.held[t] -= 1
            if s.queued[slot]:
                self._live[t] -= 1
        s.queued[slot] = False
        self._bump(slot)
        s.release(key)
        return True

    def rescale(self, slot: int, frequency: float) -> None:
        """Give a slot a new access frequency and renew its heap entry (``O(log n)``)."""
        s = self.slots
        if not s.rescale(slot, frequency):
            return
        t = int(s.tier[slot])
        if t >= 0 and s.queued[slot]:
            self._live[t] -= 1
            s.queued[slot] = False
            self._bump(slot)  # the old entry is stale now
            self._push(slot)

    def resolve(self, start_tier: int = 0) -> list[Step]:
        """While a tier is over capacity, apply its cheapest operation; recurse downwards."""
        steps: list[Step] = []
        for t in range(max(0, start_tier), len(self.capacities)):
            cap = self.capacities[t]
            while cap is not None and self.used[t] > cap:
                slot, op = self._pop(t)
                steps.append(self._apply(slot, op))
        return steps

    def room_cost(self, t: int, need_bytes: float) -> float:
        """What Algorithm 1 would give up to make ``need_bytes`` more room in tier ``t``, priced
        by its next operation there: 0 while the tier has the room, ``inf`` when nothing in it
        can be compressed, moved or dropped. Per byte freed (``per_byte``) it is that
        operation's score times the bytes short; under ``absolute`` the operation's loss. An
        estimate: the operations after the first may cost more per byte (write advice,
        engine/write_advice.py)."""
        cap = self.capacities[t]
        short = 0.0 if cap is None else self.used[t] + need_bytes - cap
        if short <= 0:
            return 0.0
        head = self._head(t)
        if head is None:
            return float("inf")
        score = key_score(head)
        return score * short if self.selection is Selection.PER_BYTE else score

    def total_utility(self) -> float:
        """Sum of the current placements' utilities."""
        s = self.slots
        live = np.flatnonzero(s.alive)
        _, cached = s.chosen(live)
        return float(np.where(s.tier[live] >= 0, cached, s.drop[live]).sum())

    # -- the cheapest operation of each context ----------------------------------------------

    def best_ops(self, slots: IntArray, t: int) -> tuple[FloatArray, IntArray, IntArray]:
        """Vectorised cheapest operation of ``slots`` (all in finite tier ``t``).

        Returns ``score`` (``inf`` when nothing frees space), target variant and target tier
        (-1 = drop) per slot. Candidates in a fixed order for deterministic ties: compress,
        move (tier-major), drop.
        """
        s = self.slots
        m = slots.size
        size, util = s.gather(slots)
        cur_v = s.variant[slots]
        cur_s = size[np.arange(m), cur_v]
        cur_u = util[np.arange(m), cur_v, t]
        n_var = size.shape[1]
        comp = util[:, :, t]
        comp = np.where((size < cur_s[:, None]) & np.isfinite(comp), comp, -np.inf)
        lower = util[:, :, t + 1 :]
        lower = np.where(size[:, :, None] <= self.caps[None, None, t + 1 :], lower, -np.inf)
        gain = np.concatenate(
            [comp, lower.transpose(0, 2, 1).reshape(m, -1), s.drop[slots, None]], 1
        )
        freed = np.concatenate(
            [cur_s[:, None] - size, np.repeat(cur_s[:, None], gain.shape[1] - n_var, 1)], 1
        )
        loss = cur_u[:, None] - gain
        with np.errstate(divide="ignore", invalid="ignore"):
            score = loss / freed if self.selection is Selection.PER_BYTE else loss
        score = np.where(np.isfinite(gain) & (freed > 0), score, np.inf)
        k = np.argmin(score, axis=1)
        best = score[np.arange(m), k]
        tier_off, var = np.divmod(k - n_var, n_var)
        tgt_t = np.where(k < n_var, t, np.where(k == gain.shape[1] - 1, DROP, t + 1 + tier_off))
        tgt_v = np.where(k < n_var, k, np.where(tgt_t == DROP, 0, var))
        return best, tgt_v.astype(np.int64), tgt_t.astype(np.int64)

    def best_op(self, slot: int, t: int) -> tuple[float, int, int]:
        """:meth:`best_ops` of one slot, in plain floats, with the same result (the same
        candidates in the same order, the first of equal scores). The heaps ask for one slot
        at a time, once or twice an insert, and the vectorised form's fixed cost was ~90 us
        of it (issue 42: a daemon taking a million small objects)."""
        s = self.slots
        row_size, row_util = s.row(slot)
        sizes: list[float] = row_size.tolist()
        util: list[list[float]] = row_util.tolist()
        cur_v = int(s.variant[slot])
        cur_s, cur_u = sizes[cur_v], util[cur_v][t]
        per_byte = self.selection is Selection.PER_BYTE
        best, best_v, best_t = math.inf, 0, t  # (argmin's answer when every score is inf)
        for v, size in enumerate(sizes):  # compress in place
            gain = util[v][t]
            if size < cur_s and math.isfinite(gain):
                score = (cur_u - gain) / (cur_s - size) if per_byte else cur_u - gain
                if score < best:
                    best, best_v, best_t = score, v, t
        if cur_s > 0:
            caps = self._caps
            for tt in range(t + 1, len(caps)):  # move down, tier by tier
                for v, size in enumerate(sizes):
                    gain = util[v][tt]
                    if size <= caps[tt] and math.isfinite(gain):
                        score = (cur_u - gain) / cur_s if per_byte else cur_u - gain
                        if score < best:
                            best, best_v, best_t = score, v, tt
            gain = float(s.drop[slot])
            if math.isfinite(gain):
                score = (cur_u - gain) / cur_s if per_byte else cur_u - gain
                if score < best:
                    best, best_v, best_t = score, 0, DROP
        return best, best_v, best_t

    # -- heaps -------------------------------------------------------------------------------

    def _bump(self, slot: int) -> None:
        self._seq += 1
        self.slots.version[slot] = self._seq

    def _push(self, slot: int) -> None:
        s = self.slots
        t = int(s.tier[slot])
        if t < 0 or self.capacities[t] is None or s.pinned[slot]:
            return
        score, _, _ = self.best_op(slot, t)
        if not math.isfinite(score):
            return
        self._seq += 1
        s.version[slot] = self._seq
        heap = self._heaps[t]
        heapq.heappush(heap, score_key(score) << SCORE_SHIFT | self._seq << SEQ_SHIFT | slot)
        s.queued[slot] = True
        self._live[t] += 1
        if len(heap) > 2 * self._live[t] + 64:
            self._compact(t)

    def _queue_all(self, t: int) -> None:
        """Build tier ``t``'s heap entries for every slot not queued yet (after a bulk install)."""
        s = self.slots
        waiting = np.flatnonzero(s.alive & (s.tier == t) & ~s.queued & ~s.pinned)
        entries = self._heaps[t]
        for start in range(0, waiting.size, 4096):
            chunk = waiting[start : start + 4096]
            score, _, _ = self.best_ops(chunk, t)
            ok = np.isfinite(score)
            chunk, score = chunk[ok], score[ok]
            seqs = range(self._seq + 1, self._seq + 1 + chunk.size)
            self._seq += chunk.size
            s.version[chunk] = np.fromiter(seqs, np.int64, chunk.size)
            entries.extend(
                k << SCORE_SHIFT | q << SEQ_SHIFT | slot
                for k, q, slot in zip(score_keys(score), seqs, chunk.tolist(), strict=True)
            )
            s.queued[chunk] = True
            self._live[t] += chunk.size
        heapq.heapify(entries)

    def _head(self, t: int) -> int | None:
        """Tier ``t``'s heap entry of the cheapest live context, left on the heap (``None``
        when there is none); stale entries above it are garbage and dropped (``_live``
        counts none of them)."""
        if t in self._unqueued:
            self._unqueued.discard(t)
            self._queue_all(t)
        heap, s = self._heaps[t], self.slots
        while heap:
            slot, version = entry_slot(heap[0])
            if s.version[slot] == version and s.alive[slot] and s.tier[slot] == t:
                return heap[0]
            heapq.heappop(heap)
        return None

    def _pop(self, t: int) -> tuple[int, tuple[int, int]]:
        s = self.slots
        while (head := self._head(t)) is not None:
            heapq.heappop(self._heaps[t])
            slot = head & SLOT_MASK
            s.queued[slot] = False
            self._live[t] -= 1
            score, v, tt = self.best_op(slot, t)
            if math.isfinite(score):
                return slot, (v, tt)
        raise CapacityError(
            f"tier {t} is over capacity ({self.used[t]:.0f} > {self.capacities[t]} bytes) and "
            "holds only pinned contexts"
        )

    def reassign(self, slot: int, variant: int, tier: int) -> Step:
        """Put a slot at ``(variant, tier)`` (tier -1: dropped) from wherever it is, keeping the
        heaps right; the caller keeps every tier within capacity (a refinement's result)."""
        s = self.slots
        src_t = int(s.tier[slot])
        if src_t >= 0 and s.queued[slot]:
            self._live[src_t] -= 1  # its entry goes stale with the version bump in _apply
        s.queued[slot] = False
        return self._apply(slot, (variant, tier))

    def _apply(self, slot: int, op: tuple[int, int]) -> Step:
        s = self.slots
        src_v, src_t = int(s.variant[slot]), int(s.tier[slot])
        dst_v, dst_t = op
        if src_t >= 0:
            self.used[src_t] -= s.size_of(slot, src_v)
            self.held[src_t] -= 1
        s.variant[slot], s.tier[slot] = dst_v, dst_t
        self._bump(slot)
        if dst_t >= 0:
            self.used[dst_t] += s.size_of(slot, dst_v)
            self.held[dst_t] += 1
            self._push(slot)
        return Step(
            s.keys[slot], src_v, None if src_t < 0 else src_t, dst_v, None if dst_t < 0 else dst_t
        )

    def _compact(self, t: int) -> None:
        s = self.slots
        live = []
        for e in self._heaps[t]:
            slot, version = entry_slot(e)
            if s.version[slot] == version and s.alive[slot] and s.tier[slot] == t:
                live.append(e)
        heapq.heapify(live)
        self._heaps[t] = live
        self._live[t] = len(live)
