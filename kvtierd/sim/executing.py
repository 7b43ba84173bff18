"""The daemon's executor as the replay needs it: a plan's operations carried out on what each
context keeps, and held back while a lookup holds the context (issue 30).

The simulator executes a placer's plans at once (in the background, as in §4.1), but not
blindly:

* without an unbounded tier a compressed context keeps only its compressed form
  (:mod:`kvtierd.sim.offers`), so a plan that asks for a form that can no longer be made is
  carried out as the daemon's executor carries it out (``engine/executor.py``, ``_keep_form``);
* a lookup that finds a context **holds** it for ``hold_s`` seconds (LMCache's pinned lookup
  through kvtierd's plugin, ``kvtierd.hold_s``, 30 s by default): the executor defers a drop
  or compression of a held context until the hold ends (``engine/executor.py``, ``_defer``),
  so meanwhile the context stays where it was and lookups still find it (they read the
  daemon's index, not the placer), each one holding it longer; a load of a context the placer
  has dropped places it again (``engine/reads.py``, ``_record_access``). Beside issue 30's
  matrix the daemon's LRU served 17 requests of seed 3 (7 of seed 2, 11 of seed 1) from
  contexts a placer without holds had dropped: each context found by a request in the 30 s
  before another's put would have dropped it.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtierd.policies.base import Placer
from kvtierd.policies.plan_order import BREAK_CYCLE
from kvtierd.sim.offers import Offers
from kvtierd.types import ContextProfile, Operation, OpKind, Placement, Plan


class ExecutingPlacer:
    """A placer whose plans are carried out as the daemon's executor carries them out: each
    operation stores the context in the form it plans, when that form can be made from what
    the context keeps (``Offers.make``); one that cannot (a plan that gives a compressed
    context back its original, whose bytes are gone) leaves the context in the form it has,
    where the plan put it, and the placer adopts that with the options the form leaves
    (``engine/executor.py``, ``_keep_form``). Each adoption narrows one context's options to
    forms it can make, so a chain of them ends. A drop or compression of a context held by a
    lookup (:meth:`found`, ``hold_s`` > 0) waits until the hold ends (module docstring)."""

    def __init__(
        self,
        placer: Placer,
        offers: Offers,
        current: Callable[[str], ContextProfile],
        hold_s: float = 0.0,
    ) -> None:
        self.placer = placer
        self._offers = offers
        self._current = current
        self._hold_s = hold_s
        self._held: dict[str, float] = {}  # context -> when its latest hold ends
        self._kept: dict[str, Placement] = {}  # where a held context stays, its change deferred

    def placement(self, context_id: str) -> Placement:
        """Where the placer has the context (``KeyError``: it never saw it)."""
        return self.placer.placement(context_id)

    def where(self, context_id: str, now_s: float) -> Placement | None:
        """Where the context's KV is at ``now_s`` (``None``: nowhere): where a hold keeps it,
        else where the placer put it. A deferred change whose hold has ended is carried out."""
        kept = self._kept.get(context_id)
        if kept is not None and self._held[context_id] > now_s:
            return kept
        if kept is not None:
            del self._kept[context_id]
            if self._placed(context_id) is None:
                self._offers.dropped(context_id)  # the deferred drop: its bytes are gone now
        return self._placed(context_id)

    def found(self, context_id: str, now_s: float) -> Placement | None:
        """A lookup at ``now_s``: where the context is (:meth:`where`), held ``hold_s`` more
        when it is found."""
        where = self.where(context_id, now_s)
        if where is not None and self._hold_s > 0:
            self._held[context_id] = now_s + self._hold_s
        return where

    def load(self, profile: ContextProfile, now_s: float) -> None:
        """A found context is loaded: an access, or, when the placer had dropped it and only a
        hold kept it, placed again as the daemon does."""
        cid = profile.context_id
        if self._placed(cid) is None:
            self._kept.pop(cid, None)
            self.insert(profile, now_s)
        else:
            self._execute(self.placer.access(cid, now_s), now_s)

    def insert(self, profile: ContextProfile, now_s: float) -> None:
        self._execute(self.placer.insert(profile), now_s)

    def _placed(self, context_id: str) -> Placement | None:
        try:
            where = self.placer.placement(context_id)
        except KeyError:
            return None
        return None if where.dropped else where

    def _deferred(self, op: Operation, now_s: float) -> bool:
        """Whether ``op`` drops or re-encodes a held context: then it waits for the hold's end
        and the context stays as it is now (the executor's ``removes``)."""
        removes = op.target.tier is None or op.target.variant != op.source.variant
        if not removes or self._held.get(op.context_id, -float("inf")) <= now_s:
            return False
        if op.source.tier is not None:
            self._kept.setdefault(op.context_id, op.source)
        return True

    def _execute(self, plan: Plan, now_s: float) -> None:
        pending = list(plan.operations)
        while pending:
            op = pending.pop(0)
            cid, target = op.context_id, op.target
            if op.kind is OpKind.DROP and op.reason == BREAK_CYCLE:
                continue  # the same plan places it again; its bytes stay (plan_order.py)
            deferred = self._deferred(op, now_s)
            if target.tier is None:
                if not deferred:
                    self._offers.dropped(cid)
            elif not self._offers.make(cid, target.variant):
                kept = Placement(self._offers.form(cid), target.tier)
                pending += self.placer.adopt(self._current(cid), kept).operations
