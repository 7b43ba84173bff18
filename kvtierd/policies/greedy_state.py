"""Incremental state of EvicPress's greedy placer (Appendix A, Algorithm 1) with lazy heaps.

Each finite tier keeps a min-heap of its contexts keyed by the *score* of their cheapest
operation that frees space in that tier: compress in place to a smaller variant, move down to any
slower tier with any variant that fits there, or drop. A context's cheapest operation depends only
on its own state, so an entry stays valid until that context changes; then its ``version`` is
bumped and a new entry pushed (lazy invalidation: stale entries are skipped when popped, and a
heap is rebuilt when more than half of it is stale). Every operation is ``O(log n)``.

Selection rules (``PlacerParams.selection``):

* ``per_byte`` (default): least utility drop per byte freed in the overflowing tier — the
  knapsack "efficiency" rule; it follows each context's concave hull.
* ``absolute``: least utility drop, however few bytes it frees — Algorithm 1 read literally
  ("the least utility drop operation").
"""

from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass

import numpy as np

from kvtierd.errors import CapacityError, InvalidArgumentError
from kvtierd.policies.model import BoolArray, FloatArray


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


@dataclass(slots=True)
class Row:
    """One context as the greedy sees it: sizes ``(V,)`` bytes, utilities ``(V, T)``.

    ``tier is None`` means dropped. Padded/invalid variants have utility ``-inf``.
    """

    key: str
    size: FloatArray
    util: FloatArray
    drop_util: float
    pinned: bool = False
    variant: int = 0
    tier: int | None = None
    version: int = 0
    queued: bool = False


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


@dataclass(frozen=True, slots=True)
class _Op:
    score: float
    variant: int
    tier: int | None


class GreedyState:
    """Per-tier used bytes, contexts and lazy heaps; :meth:`resolve` is Algorithm 1's loop."""

    def __init__(self, capacities: tuple[int | None, ...], selection: Selection) -> None:
        self.capacities = capacities
        self.selection = selection
        self.rows: dict[str, Row] = {}
        self.used = [0.0] * len(capacities)
        self._heaps: list[list[tuple[float, int, str, int]]] = [[] for _ in capacities]
        self._live = [0] * len(capacities)
        self._seq = 0
        self._unqueued: set[int] = set()

    def best_start(self, row: Row) -> tuple[int, int | None]:
        """The best configuration ignoring other contexts (Algorithm 1 line 1), fastest on ties.

        Only variants that fit in the tier alone are considered; dropping wins when nothing
        cached beats it.
        """
        util = np.where(self._fits_mask(row.size), row.util, -np.inf)
        flat = int(np.argmax(util.T))  # tier-major order: ties go to the faster tier
        tier, variant = divmod(flat, util.shape[0])
        if not np.isfinite(util[variant, tier]) or util[variant, tier] < row.drop_util:
            return 0, None
        return variant, tier

    def add(self, row: Row, variant: int, tier: int | None, *, queue: bool = True) -> None:
        """Put a context at ``(variant, tier)``; the caller then calls :meth:`resolve`.

        ``queue=False`` (bulk loads after a rebalance) defers the heap entry: the tier's heap is
        rebuilt the first time it overflows, so a rebalance pays no Python work per context.
        """
        row.variant, row.tier = variant, tier
        # Versions are unique across rows so a re-inserted context never matches a stale entry.
        self._seq += 1
        row.version = self._seq
        self.rows[row.key] = row
        if tier is not None:
            self.used[tier] += float(row.size[variant])
            if queue:
                self._push(row)
            else:
                self._unqueued.add(tier)

    def discard(self, key: str) -> Row | None:
        """Forget a context; its heap entry goes stale."""
        row = self.rows.pop(key, None)
        if row is not None and row.tier is not None:
            self.used[row.tier] -= float(row.size[row.variant])
            if row.queued:
                self._live[row.tier] -= 1
            row.version += 1
        return row

    def resolve(self, start_tier: int = 0) -> list[Step]:
        """While a tier is over capacity, apply its cheapest operation; recurse downwards."""
        steps: list[Step] = []
        for t in range(start_tier, len(self.capacities)):
            cap = self.capacities[t]
            while cap is not None and self.used[t] > cap:
                row, op = self._pop(t)
                steps.append(self._apply(row, op))
        return steps

    # -- internals -------------------------------------------------------------------------

    def _fits_mask(self, size: FloatArray) -> BoolArray:
        caps = np.array([np.inf if c is None else float(c) for c in self.capacities])
        return size[:, None] <= caps[None, :]

    def best_op(self, row: Row) -> _Op | None:
        """The cheapest operation that frees space in the row's tier, or ``None``."""
        if row.tier is None:
            return None
        v, t = row.variant, row.tier
        cur, s = float(row.util[v, t]), float(row.size[v])
        if s <= 0.0:
            return None
        # Candidates, in a fixed order for deterministic ties: compress, move (tier-major), drop.
        comp = np.where((row.size < s) & np.isfinite(row.util[:, t]), row.util[:, t], -np.inf)
        lower = np.where(self._fits_mask(row.size)[:, t + 1 :], row.util[:, t + 1 :], -np.inf)
        gain = np.concatenate([comp, lower.T.ravel(), [row.drop_util]])
        freed = np.concatenate([s - row.size, np.full(lower.size + 1, s)])
        drop = cur - gain
        score = drop / freed if self.selection is Selection.PER_BYTE else drop
        score = np.where(np.isfinite(gain), score, np.inf)
        k = int(np.argmin(score))
        if not np.isfinite(score[k]):
            return None
        n_var = row.size.shape[0]
        if k < n_var:
            return _Op(float(score[k]), k, t)
        if k == gain.shape[0] - 1:
            return _Op(float(score[k]), 0, None)
        tier_off, variant = divmod(k - n_var, n_var)
        return _Op(float(score[k]), variant, t + 1 + tier_off)

    def _push(self, row: Row) -> None:
        t = row.tier
        if t is None or self.capacities[t] is None or row.pinned:
            return
        op = self.best_op(row)
        if op is None:
            return
        self._seq += 1
        heap = self._heaps[t]
        heapq.heappush(heap, (op.score, self._seq, row.key, row.version))
        row.queued = True
        self._live[t] += 1
        if len(heap) > 2 * self._live[t] + 64:
            self._compact(t)

    def _pop(self, t: int) -> tuple[Row, _Op]:
        if t in self._unqueued:
            self._unqueued.discard(t)
            for waiting in list(self.rows.values()):
                if waiting.tier == t and not waiting.queued:
                    self._push(waiting)
        heap = self._heaps[t]
        while heap:
            _, _, key, version = heapq.heappop(heap)
            row = self.rows.get(key)
            if row is None or row.version != version or row.tier != t:
                continue
            row.queued = False
            self._live[t] -= 1
            op = self.best_op(row)
            if op is not None:
                return row, op
        raise CapacityError(
            f"tier {t} is over capacity ({self.used[t]:.0f} > {self.capacities[t]} bytes) and "
            "holds only pinned contexts"
        )

    def _apply(self, row: Row, op: _Op) -> Step:
        step = Step(row.key, row.variant, row.tier, op.variant, op.tier)
        if row.tier is None:
            raise AssertionError(f"{row.key!r} is dropped: no operation applies")
        self.used[row.tier] -= float(row.size[row.variant])
        self._seq += 1
        row.version = self._seq
        row.variant, row.tier = op.variant, op.tier
        if op.tier is not None:
            self.used[op.tier] += float(row.size[op.variant])
            self._push(row)
        return step

    def _compact(self, t: int) -> None:
        live = [
            e
            for e in self._heaps[t]
            if (r := self.rows.get(e[2])) is not None and r.version == e[3] and r.tier == t
        ]
        heapq.heapify(live)
        self._heaps[t] = live
        self._live[t] = len(live)
