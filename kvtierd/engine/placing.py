"""The running placer and what it is told: the profile of a context (from its options,
``context_options.py``), where a context is, and the plans it answers with (the caller submits
them to the executor). A hot policy reload swaps the placer (``AdminOps.apply_policy``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from kvtierd.engine.context_options import ContextOptions
from kvtierd.engine.index import ContextIndex
from kvtierd.engine.option_rows import OptionRows
from kvtierd.engine.state import ContextRecord, RunningPolicy
from kvtierd.errors import ConfigError
from kvtierd.heap import collector_paused, trim
from kvtierd.policies import Placer, PlacerParams, placer_class
from kvtierd.policies.model import OptionArrays
from kvtierd.policy_config import PLACER_PARAMS_FIELDS, PolicyConfig
from kvtierd.storage import CpuTier, Tier
from kvtierd.types import (
    DROPPED,
    ContextProfile,
    Operation,
    OpKind,
    Placement,
    Plan,
    TierModel,
)
from kvtierd.utility import check_tiers

logger = logging.getLogger(__name__)

# Up to this many contexts found at start are adopted before the daemon answers; more are
# adopted in the background after (issue 42.5): adoption costs 0.1-0.5 ms a context (the
# option rows, the placer's table), minutes at 1M, while the index alone is enough to serve.
ADOPT_BEFORE_SERVING = 10_000
ADOPT_SLICE = 1_000  # contexts adopted between two turns of the event loop
ROUNDING_SLACK_SHARE = 64  # held back beyond the CPU tier's rounding: 1/64 of its arena


def tier_models(tiers: Mapping[str, Tier], cpu: CpuTier) -> list[TierModel]:
    """Load time per tier, from the tiers' read fits (overhead + bandwidth of real reads;
    a tier that has timed no read yet gives its kind's prior, never 0). A host reader
    copies every load out of the arena (the CPU tier's read fit); an object in another
    tier is first read into the arena (that tier's fit)."""
    arena = cpu.load_fit()
    models = []
    for t in tiers.values():
        load = arena if t is cpu else t.load_fit().then(arena)
        capacity = t.capacity_bytes or None
        models.append(TierModel(t.name, capacity, load.bytes_per_s, load.overhead_s))
    check_tiers(models)
    return models


class Placing:
    """The placer of the running policy, over the contexts of ``index``."""

    def __init__(
        self,
        *,
        index: ContextIndex,
        options: ContextOptions,
        tiers: Mapping[str, Tier],
        cpu: CpuTier,
        policy: RunningPolicy,
    ) -> None:
        self._index = index
        self._options = options
        self._tiers = tiers
        self._cpu = cpu
        self._policy = policy
        self._held_back = 0  # of the CPU tier, for its blocks' rounding (hold_back_rounding)
        self.placer = self.make_placer(policy.current)
        self.rows = OptionRows(options)
        # Contexts found at start that the placer has not been told of yet (adopt_found).
        self._unadopted: set[str] = set()
        self.adopting: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return self.placer.name

    def tier_models(self) -> list[TierModel]:
        return tier_models(self._tiers, self._cpu)

    def make_placer(self, policy: PolicyConfig) -> Placer:
        """A placer for ``policy`` over the tiers as measured now."""
        try:
            cls = placer_class(policy.placer)
        except ValueError as e:
            raise ConfigError(f"{policy.source}: {e}") from e
        known = {f.name for f in dataclasses.fields(PlacerParams)}
        params = PlacerParams(
            **{f: getattr(policy, a) for f, a in PLACER_PARAMS_FIELDS.items() if f in known}
        )
        placer = cls(self.tier_models(), params)
        self._link_all(placer)
        if self._held_back:
            placer.hold_back(self._cpu.name, self._held_back, plan=False)  # nothing placed yet
        return placer

    def profile(self, ctx: ContextRecord, *, fresh: bool = False) -> ContextProfile:
        """What the placer knows of a context: its variants (sizes; quality once profiled),
        decayed frequency, recency, protection (``pinned``: not a lookup's hold, which ends on
        its own — a placer told of it would keep the context pinned after it; the executor
        defers what a hold forbids, executor.py). From the context's kept row
        (``option_rows.py``), rebuilt first when ``fresh``."""
        return self.rows.profile(ctx, fresh=fresh)

    def placed(self) -> list[ContextRecord]:
        """Every context the placer decides on (not those held for their unread durable
        objects, durable.py)."""
        return [c for c in self._index.contexts.values() if not c.durable_held]

    def placed_options(self) -> OptionArrays:
        """The options of every context the placer decides on, as arrays."""
        contexts = self._index.contexts
        if len(self.rows) > 2 * len(contexts) + 1024:  # rows of contexts gone outside remove()
            self.rows.prune(contexts)
        return self.rows.arrays(self.placed())

    def placed_profiles(self) -> list[ContextProfile]:
        """:meth:`placed_options` as one profile per context (the general, slow path)."""
        return self.placed_options().profiles()

    def rebalance(self, reason: str = "rebalance") -> Plan:
        """Recompute every placement from the contexts' kept options (the tiers' load models
        refreshed first: bandwidths measured since) and return what brings every context
        there (:meth:`reconcile`). Python's cyclic garbage collector waits meanwhile: the
        pass allocates a few objects per context, and each full collection it would trigger
        walks every object the daemon holds (millions at 100,000 contexts: seconds each)."""
        with collector_paused():
            self.placer.refresh_tiers(self.tier_models())
            if self._held_back:  # at today's mix of object sizes; the rebalance places anew
                self.hold_back_rounding(refused=False)
            self._link_all(self.placer)
            self.placer.rebalance_options(self.placed_options(), self.quota_floors())
            self.all_adopted()
            return self.reconcile(reason)

    def hold_back_rounding(self, refused: bool = True) -> Plan:
        """Have the placer keep free the room the CPU tier's blocks take beyond its objects'
        bytes, and return the plan that frees it (empty when the amount held is unchanged, and
        for a rebalance, which places every context anew).

        The placer counts a context's bytes; the arena gives each object whole 4 KiB blocks.
        A CPU tier of 1-16 KiB objects at its capacity in bytes filled its arena (capacity +
        staging) with the rounding: every put refused, and no move planned, since only a put
        makes the placer move contexts down (issue 42's bench_scale wedged at 569k objects).

        ``refused``: a put found the arena full and no move queued (the write path). Where
        the tier's blocks then take more than its capacity, the amount held back grows by at
        least 1/:data:`ROUNDING_SLACK_SHARE` of the arena, so each such put frees room. Else
        (puts in flight, reads) nothing is held back for it. A rebalance passes ``False``:
        the amount follows the present mix of sizes, when it moved by that much. The amount
        is the rounding of a full tier at that mix: with ``r`` bytes of rounding per byte held
        now, a tier of capacity ``C`` holds ``C / (1 + r)`` bytes, so ``C * r / (1 + r)``,
        plus the same 1/64 of the arena for the mix to drift."""
        cpu = self._cpu
        used, capacity = cpu.used_bytes(), cpu.capacity_bytes
        rounding = cpu.rounding_bytes()
        if not used or not capacity or (refused and used + rounding <= capacity):
            return Plan()
        held, slack = self._held_back, cpu.arena.allocator.size_bytes // ROUNDING_SLACK_SHARE
        r = rounding / used
        wanted = int(capacity * r / (1 + r)) + slack
        if refused:
            wanted = max(wanted, held + slack)
        elif abs(wanted - held) < slack:
            return Plan()
        wanted = min(capacity, wanted)
        if wanted == held:
            return Plan()
        logger.info(
            "tier %s: the placer keeps %d MiB of it free for the arena's block rounding "
            "(%d objects take %.2fx their bytes; was %d MiB)",
            cpu.name, wanted >> 20, cpu.object_count(), 1 + r, held >> 20,
        )  # fmt: skip
        self._held_back = wanted
        return self.placer.hold_back(cpu.name, wanted, plan=refused)

    # -- telling the placer --------------------------------------------------------------------

    def _link_all(self, placer: Placer) -> None:
        """Give ``placer`` the tree as the index has it now (issue 29: tree_joins.py), less
        the contexts held for their unread durable objects: they are outside the placer's
        view, so outside its tree too. Linked, a held child was one the placer could not find
        when its parent was dropped (issue 40.3: ``KeyError`` in another tenant's put)."""
        placer.parents.clear()
        placer.children.clear()
        contexts = self._index.contexts
        for parent, kids in self._index.children.items():
            if contexts[parent].durable_held:
                continue
            for kid in kids:
                if not contexts[kid].durable_held:
                    placer.link(kid, parent)

    def relink(self, ctx: ContextRecord) -> None:
        """Tell the placer ``ctx``'s parent, which changed (a split moved it below the new
        child): the placer's tree is the index's, less the held contexts."""
        self._link(ctx)

    def _link(self, ctx: ContextRecord) -> None:
        parent = self._index.contexts.get(ctx.parent) if ctx.parent else None
        if ctx.durable_held or (parent is not None and parent.durable_held):
            return  # a held context is outside the placer's tree (:meth:`_link_all`)
        if ctx.parent or ctx.context_id in self.placer.parents:
            self.placer.link(ctx.context_id, ctx.parent)

    def target(self, context_id: str) -> Placement:
        """Where the placer has a context now (``DROPPED`` for one it does not keep)."""
        try:
            return self.placer.placement(context_id)
        except KeyError:
            return DROPPED

    def adopt_found(
        self, contexts: Sequence[ContextRecord], submit: Callable[[Plan], None]
    ) -> None:
        """Tell the placer where each context found at start is, and ``submit`` what it
        answers (overflows resolved). Up to :data:`ADOPT_BEFORE_SERVING` contexts are adopted
        now; more are adopted by a background task (:attr:`adopting`), a slice per turn of the
        event loop, while the daemon serves from the index. Meanwhile the placer under-counts
        the tiers' bytes by the contexts it has not adopted yet: a put may be placed where an
        adopt then finds an overflow, which that adopt resolves as at start. A context the
        placer learns of otherwise first (a put, a rebalance) is not adopted again."""
        if len(contexts) <= ADOPT_BEFORE_SERVING:
            for ctx in contexts:
                submit(self.adopt_where_it_is(ctx))
            return
        self._unadopted = {ctx.context_id for ctx in contexts}
        logger.info("adopting %d contexts found at start in the background", len(contexts))
        self.adopting = asyncio.create_task(
            self._adopt_in_background(contexts, submit), name="kvtierd-adopt-found"
        )

    async def _adopt_in_background(
        self, contexts: Sequence[ContextRecord], submit: Callable[[Plan], None]
    ) -> None:
        started, adopted = time.perf_counter(), 0
        for first in range(0, len(contexts), ADOPT_SLICE):
            for ctx in contexts[first : first + ADOPT_SLICE]:
                cid = ctx.context_id
                if cid not in self._unadopted or self._index.contexts.get(cid) is not ctx:
                    continue  # known to the placer already, or gone from the index
                try:
                    submit(self.adopt_where_it_is(ctx))
                    adopted += 1
                except Exception:  # one context's fault must not stop the others' adoption
                    self._unadopted.discard(cid)
                    logger.exception("context %r found at start: not adopted", cid)
            await asyncio.sleep(0)
        self._unadopted.clear()
        logger.info("adopted %d contexts found at start in %.1f s (in the background)",
                    adopted, time.perf_counter() - started)  # fmt: skip
        trim("adopting the contexts found at start")

    @property
    def unadopted(self) -> int:
        """Contexts found at start the placer has not been told of yet."""
        return len(self._unadopted)

    def all_adopted(self) -> None:
        """The placer was given every context at once (a rebalance, a new policy)."""
        self._unadopted.clear()

    async def close(self) -> None:
        if self.adopting is not None:
            self.adopting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.adopting
            self.adopting = None

    def adopt(self, ctx: ContextRecord, placement: Placement) -> Plan:
        """Tell the placer where the context is. A context held for its unread durable
        objects stays outside the placer's view until they are read (durable.py)."""
        self._unadopted.discard(ctx.context_id)
        if ctx.durable_held and self._index.unread_durable(ctx):
            return Plan()
        ctx.durable_held = False
        self._link(ctx)
        return self.placer.adopt(self.profile(ctx), placement)

    def relearn(self, ctx: ContextRecord) -> Plan:
        """Tell the placer the options a context has now (its form changed outside a plan:
        ``Placer.relearn``), and where its bytes are."""
        if ctx.durable_held:
            return Plan()
        return self.placer.relearn(self.profile(ctx), self._index.placement_of(ctx))

    def adopt_where_it_is(self, ctx: ContextRecord) -> Plan:
        return self.adopt(ctx, self._index.placement_of(ctx))

    def insert(self, ctx: ContextRecord) -> Plan:
        """Place the context afresh (new, grown, profiled, or back in the placer's view): its
        options are worked out again, whatever changed."""
        self._unadopted.discard(ctx.context_id)
        self._link(ctx)
        profile = self.profile(ctx, fresh=True)
        floor = self._quota_floor(ctx)
        if not floor:
            return self.placer.insert(profile)
        # Its tenant's or namespace's quota is full in the faster tiers: the placer learns it
        # in the first tier with room for it there, so that it never makes room above by
        # moving down another's contexts for a context the quota then sends down (issue 41.2).
        here, there = self._index.placement_of(ctx), Placement(ctx.variant, floor)
        plan = self.placer.adopt(profile, there)
        if here.tier == floor or here.dropped:
            return plan
        return Plan((Operation(OpKind.MOVE, ctx.context_id, here, there, "quota"),)) + plan

    def quota_floors(self) -> dict[str, str]:
        """Per placed context whose tenant's or namespace's quota is full in the faster tiers,
        the fastest tier it may go to (what a rebalance is told: one that placed it higher
        moved other contexts down for it, and the executor then kept it out, issue 41.2)."""
        index = self._index
        if not index.has_quotas:
            return {}
        floors = {}
        for ctx in self.placed():
            floor = self._quota_floor(ctx)
            if floor:
                floors[ctx.context_id] = floor
        return floors

    def _quota_floor(self, ctx: ContextRecord) -> str:
        """The fastest tier where the context fits its tenant's and namespace's quotas, when
        that is not the fastest tier (``""``: the fastest, or none: the executor drops it)."""
        names = list(self._tiers)
        if not self._index.has_quotas or not ctx.keys or not names:
            return ""  # (every hit asks: without quotas nothing to look up)
        tier = self._index.quota_tier(ctx, names[0], names)
        return tier if tier is not None and tier != names[0] else ""

    def access(self, context_id: str, now_s: float) -> Plan:
        """Record a hit. A promotion goes no higher than the fastest tier with room in the
        context's tenant's and namespace's quotas, as its first placement (:meth:`insert`):
        LRU promoted a context of a namespace full in the CPU tier there, moving another
        namespace's context down for it, and the executor then kept it out (issue 41.2)."""
        ctx = self._index.contexts.get(context_id)
        floor = self._quota_floor(ctx) if ctx is not None else ""
        return self.placer.access(context_id, now_s, fastest=floor)

    def remove(self, context_id: str) -> None:
        self._unadopted.discard(context_id)
        self.placer.remove(context_id)
        self.rows.forget(context_id)
        self.placer.unlink(context_id)
        for child in list(self.placer.children.get(context_id, ())):
            self.placer.unlink(child)  # the index made it a root (ContextIndex.forget_context)

    def reconcile(self, reason: str) -> Plan:
        """Operations that bring every context to where the placer now wants it. Built from
        the placer's state, not its plan: a fresh placer's plan is relative to its own empty
        view, while this is relative to where the bytes really are. One pass over the
        contexts, comparing names (a :class:`Placement` is made only for a context that
        moves)."""
        contexts = self.placed()
        targets = self.placer.placements([c.context_id for c in contexts])
        objects = self._index.objects
        sources: dict[tuple[str, str], Placement] = {}  # one per (variant, tier), as targets
        ops = []
        for ctx, target in zip(contexts, targets, strict=True):
            keys = ctx.keys
            tier = objects[next(iter(keys))].tier if keys else None
            if target.tier == tier and (tier is None or target.variant == ctx.variant):
                continue
            # ContextIndex.placement_of, from the tier just read (a rebalance that moves most
            # of 100,000 contexts looked each one's tier up twice).
            if tier is None:
                source = DROPPED
            else:
                source = sources.get((ctx.variant, tier)) or sources.setdefault(
                    (ctx.variant, tier), Placement(ctx.variant, tier)
                )
            if target.dropped:
                kind = OpKind.DROP
            elif target.variant != source.variant:
                kind = OpKind.COMPRESS
            else:
                kind = OpKind.MOVE
            ops.append(Operation(kind, ctx.context_id, source, target, reason))
        return Plan(tuple(ops))
