"""``lru``: eviction only, no compression — the daemon's first placer and a paper baseline.

New and re-accessed contexts go to the fastest tier; when a tier overflows, its least recently
used contexts move one tier down; the last tier drops them (an unbounded tier keeps all).
Pinned contexts are never moved down. Every operation is O(1) amortised (ordered dicts).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence

from kvtierd.policies.base import Placer, PlacerParams
from kvtierd.policies.plan_order import Change, order_changes
from kvtierd.types import (
    DROPPED,
    ORIGINAL_VARIANT,
    ContextProfile,
    Operation,
    OpKind,
    Placement,
    Plan,
    TierModel,
)


class LruPlacer(Placer):
    name = "lru"

    def __init__(self, tiers: Sequence[TierModel], params: PlacerParams | None = None) -> None:
        super().__init__(tiers, params)
        # Per tier its recency list (least recently used first): each context's size in bytes,
        # in the list of the tier it is in (:meth:`_level` looks it up there: a dict of each
        # context's tier was 38 bytes of a restart's ~1.1 KB an object, issue 42). The few
        # pinned contexts and those in another form than the original are kept aside: an
        # entry object per context was 64 bytes an object.
        self._lru: list[OrderedDict[str, int]] = [OrderedDict() for _ in self.tiers]
        self._pinned: set[str] = set()
        self._variants: dict[str, str] = {}  # context -> its form, when not the original
        self._used = [0] * len(self.tiers)
        self._gone: dict[str, int] = {}  # sizes of contexts dropped while building a plan

    def _fits_anywhere(self, size_bytes: int) -> bool:
        return any(t.capacity_bytes is None or size_bytes <= t.capacity_bytes for t in self.tiers)

    def _variant_for(self, profile: ContextProfile) -> str:
        """The variant this placer stores: the original, or — for a context a client stored
        already compressed — the form it has (eviction only never changes it; ``fixed``
        overrides this)."""
        names = [v.variant for v in profile.variants]
        return ORIGINAL_VARIANT if ORIGINAL_VARIANT in names else names[0]

    def _victims(self, level: int) -> Iterator[str]:
        """Contexts of a tier in eviction order (least recently used first; ``lfu`` overrides),
        read a few at a time: a spill moves down a few contexts of a tier that may hold
        100,000s (a copy of the whole list per adopt made a restart quadratic: 20,000 contexts
        took 10 s). The caller demotes what it is given before asking for the next."""
        recency, given = self._lru[level], set[str]()
        while True:
            batch = list(itertools.islice((c for c in recency if c not in given), 64))
            if not batch:
                return
            given.update(batch)
            yield from batch

    def _touch(self, cid: str) -> None:
        """Record a use (``lfu`` counts them)."""

    def insert(self, profile: ContextProfile) -> Plan:
        return self._insert(profile, top=0)

    def _insert(self, profile: ContextProfile, top: int) -> Plan:
        """:meth:`insert` into tier ``top`` or below."""
        variant = self._variant_for(profile)
        size = profile.variant(variant).size_bytes
        cid = profile.context_id
        self._touch(cid)
        level = self._level(cid)
        known = level is not None
        source = self.placement(cid) if known else DROPPED
        if level is not None:
            self._unplace(cid, level)
        if not self._fits_anywhere(size):
            self._forget_form(cid)
            op = Operation(OpKind.DROP, cid, source, DROPPED, "larger than every tier")
            return Plan((op,)) if known else Plan()
        tier = max(self._first_tier_for(size), top)
        self._place(cid, tier, size)
        self._set_form(cid, profile.pinned, variant)
        target = Placement(variant, self.tiers[tier].name)
        kind = OpKind.MOVE if known else OpKind.PLACE
        ops = [] if source == target else [Operation(kind, cid, source, target, "most recent")]
        return self._ordered(Plan(tuple(ops)) + self._spill(tier, protect=cid), cid, size)

    def adopt(self, profile: ContextProfile, placement: Placement) -> Plan:
        if placement.tier is None:
            return Plan()
        tier = self._tier_index(placement.tier)
        self.remove(profile.context_id)
        size = profile.variant(placement.variant).size_bytes
        self._place(profile.context_id, tier, size)
        self._set_form(profile.context_id, profile.pinned, placement.variant)
        return self._spill(tier, protect=profile.context_id)

    def access(self, context_id: str, now_s: float, fastest: str = "") -> Plan:
        tier = self._level(context_id)
        if tier is None:
            return Plan()
        self._touch(context_id)
        top = self._tier_index(fastest) if fastest else 0
        if tier <= top or context_id in self._pinned:
            self._lru[tier].move_to_end(context_id)
            return Plan()
        source = self.placement(context_id)
        size = self._unplace(context_id, tier)
        tier = max(self._first_tier_for(size), top)
        self._place(context_id, tier, size)
        target = Placement(source.variant, self.tiers[tier].name)
        if source == target:
            return Plan()
        op = Operation(OpKind.MOVE, context_id, source, target, "promoted on access")
        return self._ordered(Plan((op,)) + self._spill(tier, protect=context_id), context_id, size)

    def remove(self, context_id: str) -> None:
        level = self._level(context_id)
        if level is not None:
            self._unplace(context_id, level)
            self._forget_form(context_id)

    def placement(self, context_id: str) -> Placement:
        tier = self._level(context_id)
        if tier is None:
            raise KeyError(context_id)
        return Placement(self._variants.get(context_id, ORIGINAL_VARIANT), self.tiers[tier].name)

    def rebalance(
        self, profiles: Sequence[ContextProfile], fastest: Mapping[str, str] | None = None
    ) -> Plan:
        before = {cid: self.placement(cid) for recency in self._lru for cid in recency}
        self._pinned.clear()
        self._variants.clear()
        self._lru = [OrderedDict() for _ in self.tiers]
        self._used = [0] * len(self.tiers)
        plan = Plan()
        floors = {cid: self._tier_index(name) for cid, name in (fastest or {}).items()}
        for profile in sorted(profiles, key=lambda p: p.last_access_s):
            plan = plan + self._insert(profile, top=floors.get(profile.context_id, 0))
        # Express the result relative to what was placed before the rebalance.
        ops = []
        for cid, source in before.items():
            target = self.placement(cid) if self._level(cid) is not None else DROPPED
            if source != target:
                kind = OpKind.DROP if target.dropped else OpKind.MOVE
                ops.append(Operation(kind, cid, source, target, "rebalance"))
        for cid in [cid for recency in self._lru for cid in recency]:
            if cid not in before:
                target = self.placement(cid)
                ops.append(Operation(OpKind.PLACE, cid, DROPPED, target, "rebalance"))
        return Plan(tuple(ops))

    # -- internals -------------------------------------------------------------------------

    def _capacity_changed(self, tier: int, plan: bool) -> Plan:
        """Spill the least recently used contexts of a tier that shrank (:meth:`hold_back`)."""
        return self._spill(tier, protect="") if plan else Plan()

    def _ordered(self, plan: Plan, cid: str, size_bytes: int) -> Plan:
        """Net change per context, ordered so no prefix overflows a tier (spills run first).

        ``cid`` is the inserted or promoted context (its size may be new); every other context
        keeps its size. Dropped contexts are in no tier's recency list any more.
        """
        first: dict[str, Placement] = {}
        last: dict[str, Placement] = {}
        for op in plan.operations:
            first.setdefault(op.context_id, op.source)
            last[op.context_id] = op.target
        changes = []
        for c, src in first.items():
            tier = self._level(c)
            size = (
                size_bytes
                if c == cid
                else (self._lru[tier][c] if tier is not None else self._gone.get(c, 0))
            )
            changes.append(Change(c, src, last[c], size, size, "lru"))
        self._gone.clear()
        used = {t.name: float(u) for t, u in zip(self.tiers, self._used, strict=True)}
        return order_changes(changes, self.tiers, used)

    def _tier_index(self, name: str) -> int:
        names = [t.name for t in self.tiers]
        if name not in names:
            raise ValueError(f"unknown tier {name!r}; tiers: {', '.join(names)}")
        return names.index(name)

    def _first_tier_for(self, size_bytes: int) -> int:
        for i, tier in enumerate(self.tiers):
            if tier.capacity_bytes is None or size_bytes <= tier.capacity_bytes:
                return i
        raise AssertionError("caller checked _fits_anywhere")

    def _level(self, cid: str) -> int | None:
        """The tier the context is in (an index into ``self.tiers``; ``None``: in none), found
        in the tiers' recency lists: two or three lookups, not a dict entry per context."""
        for level, recency in enumerate(self._lru):
            if cid in recency:
                return level
        return None

    def _place(self, cid: str, tier: int, size_bytes: int) -> None:
        """Put the context in ``tier``, most recently used."""
        self._lru[tier][cid] = size_bytes
        self._used[tier] += size_bytes

    def _unplace(self, cid: str, tier: int) -> int:
        """Take the context out of ``tier``'s recency list (the tier it is in); returns its
        size (its form stays known until :meth:`_place` or :meth:`_forget_form`)."""
        size = self._lru[tier].pop(cid)
        self._used[tier] -= size
        return size

    def _set_form(self, cid: str, pinned: bool, variant: str) -> None:
        if pinned:
            self._pinned.add(cid)
        else:
            self._pinned.discard(cid)
        if variant == ORIGINAL_VARIANT:
            self._variants.pop(cid, None)
        else:
            self._variants[cid] = variant

    def _forget_form(self, cid: str) -> None:
        """The context leaves the placer (taken out of its tier first)."""
        self._pinned.discard(cid)
        self._variants.pop(cid, None)

    def _over(self, tier: int) -> bool:
        cap = self.tiers[tier].capacity_bytes
        return cap is not None and self._used[tier] > cap

    def _spill(self, tier: int, protect: str) -> Plan:
        """Move least recently used contexts down until every tier from ``tier`` fits."""
        ops: list[Operation] = []
        for level in range(tier, len(self.tiers)):
            if not self._over(level):
                continue
            victims = (c for c in self._victims(level) if c != protect)
            while self._over(level):
                cid = next(victims, None)
                if cid is None:
                    break  # only pinned or protected contexts left: nothing movable
                if cid in self._pinned:
                    continue
                ops.append(self._demote(cid, level))
        return Plan(tuple(ops))

    def _demote(self, cid: str, level: int) -> Operation:
        source = self.placement(cid)
        size = self._unplace(cid, level)
        below = level + 1
        while below < len(self.tiers):
            cap = self.tiers[below].capacity_bytes
            if cap is None or size <= cap:
                self._place(cid, below, size)
                target = Placement(source.variant, self.tiers[below].name)
                return Operation(OpKind.MOVE, cid, source, target, "least recently used")
            below += 1
        self._forget_form(cid)
        self._gone[cid] = size
        return Operation(OpKind.DROP, cid, source, DROPPED, "least recently used, last tier full")
