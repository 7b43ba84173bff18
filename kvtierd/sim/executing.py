"""The daemon's executor as the replay needs it: a plan's operations carried out on what each
context keeps (issue 30).

The simulator executes a placer's plans at once (in the background, as in §4.1), but not
blindly: without an unbounded tier a compressed context keeps only its compressed form
(:mod:`kvtierd.sim.offers`), so a plan that asks for a form that can no longer be made is
carried out as the daemon's executor carries it out (``engine/executor.py``, ``_keep_form``).
"""

from __future__ import annotations

from collections.abc import Callable

from kvtierd.policies.base import Placer
from kvtierd.policies.plan_order import BREAK_CYCLE
from kvtierd.sim.offers import Offers
from kvtierd.types import ContextProfile, OpKind, Placement, Plan


class ExecutingPlacer:
    """A placer whose plans are carried out as the daemon's executor carries them out: each
    operation stores the context in the form it plans, when that form can be made from what
    the context keeps (``Offers.make``); one that cannot (a plan that gives a compressed
    context back its original, whose bytes are gone) leaves the context in the form it has,
    where the plan put it, and the placer adopts that with the options the form leaves
    (``engine/executor.py``, ``_keep_form``). Each adoption narrows one context's options to
    forms it can make, so a chain of them ends."""

    def __init__(
        self, placer: Placer, offers: Offers, current: Callable[[str], ContextProfile]
    ) -> None:
        self.placer = placer
        self._offers = offers
        self._current = current

    def placement(self, context_id: str) -> Placement:
        return self.placer.placement(context_id)

    def insert(self, profile: ContextProfile) -> None:
        self._execute(self.placer.insert(profile))

    def access(self, context_id: str, now_s: float) -> None:
        self._execute(self.placer.access(context_id, now_s))

    def _execute(self, plan: Plan) -> None:
        pending = list(plan.operations)
        while pending:
            op = pending.pop(0)
            cid, target = op.context_id, op.target
            if op.kind is OpKind.DROP and op.reason == BREAK_CYCLE:
                continue  # the same plan places it again; its bytes stay (plan_order.py)
            if target.tier is None:
                self._offers.dropped(cid)
            elif not self._offers.make(cid, target.variant):
                kept = Placement(self._offers.form(cid), target.tier)
                pending += self.placer.adopt(self._current(cid), kept).operations
