"""The put path: allocations through the arena, commits (checksums, durable write-through),
puts by stream, model cards, and deletes; what the placer is told of each new object."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace

from kvtierd.config import DaemonConfig
from kvtierd.engine.durable import DurableGuard
from kvtierd.engine.executor import Executor
from kvtierd.engine.index import ContextIndex
from kvtierd.engine.leases import LeaseTable
from kvtierd.engine.mover import TierMover
from kvtierd.engine.placing import Placing
from kvtierd.engine.profiling.profiling_service import ProfilingService
from kvtierd.engine.servable import card_tenant, save_card
from kvtierd.engine.state import AllocationRecord, ContextRecord, ObjectRecord
from kvtierd.engine.tree_joins import check_parent
from kvtierd.engine.validate import check_one_layout, validate_meta
from kvtierd.errors import (
    AlreadyExistsError,
    CapacityError,
    InvalidArgumentError,
    KvtierError,
    PermissionDeniedError,
)
from kvtierd.kernels.placeholder import MODEL_CARD_LAYOUT, ModelCard, model_card_key
from kvtierd.metrics import Metrics
from kvtierd.storage.ssd_format import data_checksum
from kvtierd.types import ObjectMeta, Operation, OpKind, Placement, Plan

logger = logging.getLogger(__name__)

MAX_CARDS_PER_TENANT = 8


class WritePath:
    """Puts and deletes of objects in ``index`` (the engine checks it is open first)."""

    def __init__(
        self,
        *,
        config: DaemonConfig,
        index: ContextIndex,
        leases: LeaseTable,
        mover: TierMover,
        durable: DurableGuard,
        placing: Placing,
        executor: Executor,
        profiling: ProfilingService,
        metrics: Metrics,
        model_cards: dict[str, ModelCard],
    ) -> None:
        self._config = config
        self._index = index
        self._leases = leases
        self._mover = mover
        self._cpu = mover.cpu  # the arena every put goes through
        self._durable = durable
        self._placing = placing
        self._executor = executor
        self._profiling = profiling
        self._metrics = metrics
        self._model_cards = model_cards  # by <tenant>/<model> (<model>: the default tenant's)
        self._card_sizes: dict[str, int] = {}
        self._tenants = frozenset(t.name for t in config.tenants)

    def allocate(self, metas: Sequence[ObjectMeta]) -> list[AllocationRecord]:
        largest = max((t.capacity_bytes or 1 << 62) for t in self._mover.tiers.values())
        seen: set[str] = set()
        table = self._leases
        for meta in metas:
            validate_meta(meta, min(largest, self._config.max_object_bytes))
            check_parent(self._index, meta)
            check_one_layout(meta, self._same_context(meta, metas))
            if meta.key in self._index.objects or meta.key in seen or table.allocating(meta.key):
                raise AlreadyExistsError(f"object {meta.key!r} already exists or is being put")
            seen.add(meta.key)
        held = Counter(table.in_flight_bytes())
        held.update(self._card_bytes())  # a tenant's cards count against its quota
        spaces = self._index.namespace_bytes(a.meta for a in table.allocations.values())
        self._index.check_quota(metas, held, spaces)
        # the arena's reserve for reads holds while queued moves down will free room
        queued = self._executor.pending > 0
        try:
            return table.allocate(metas, self._config.allocation_timeout_s, keep_reserve=queued)
        except CapacityError:
            if not queued:  # nothing queued will free the arena: the placer's count is short
                self._executor.submit(self._placing.hold_back_rounding())
            raise

    def _same_context(self, meta: ObjectMeta, batch: Sequence[ObjectMeta]) -> Iterator[ObjectMeta]:
        """The objects of ``meta``'s context: held, being put, and the rest of this put."""
        ctx = self._index.contexts.get(meta.context)
        if ctx is not None:
            yield from (self._index.objects[k].meta for k in ctx.keys)
        yield from (a.meta for a in self._leases.allocations.values()
                    if a.meta.context == meta.context)  # fmt: skip
        yield from (m for m in batch if m.context == meta.context)

    def _card_bytes(self) -> Counter[str]:
        """The bytes of the model cards each tenant keeps."""
        out: Counter[str] = Counter()
        for name, card in self._model_cards.items():
            size = self._card_sizes.get(name)
            if size is None:  # a card kept from an earlier run
                size = self._card_sizes[name] = len(card.to_bytes())
            out[self._card_tenant(name)] += size
        return out

    def _card_tenant(self, name: str) -> str:
        return card_tenant(name, self._tenants)

    async def commit(
        self, allocation_ids: Sequence[str], durable: bool = False
    ) -> list[ObjectMeta]:
        recs = self._leases.to_commit(allocation_ids)
        self._verify_checksums(recs)
        cards = self._read_cards(recs)
        metas = []
        grown: dict[str, ContextRecord] = {}
        born: set[str] = set()  # contexts this commit starts
        for rec in recs:
            self._leases.committed(rec)
            if rec.allocation_id in cards:  # kept by the engine, no object
                self._cpu.free_block(rec.block)
                self._keep_card(rec.meta, cards[rec.allocation_id])
                metas.append(rec.meta)
                continue
            if rec.meta.context not in self._index.contexts:
                born.add(rec.meta.context)
            meta = self._index.numbered(rec.meta)  # one ObjectMeta for the tier and the index
            ctx = self._add_object(self._cpu.adopt(meta, rec.block), self._cpu.name)
            grown[ctx.context_id] = ctx
            metas.append(rec.meta)
            seconds = time.monotonic() - rec.created_s  # includes the client's copy in
            self._metrics.observe_store(self._cpu.name, seconds, rec.meta.size_bytes)
        kept = [m for m in metas if m.layout != MODEL_CARD_LAYOUT]
        try:
            if durable:  # before any plan can meet them (durable.py, ``mark``)
                self._durable.mark(kept)
            for ctx in grown.values():
                self._place_grown(ctx, self._cpu.name)
                parent = self._index.contexts.get(ctx.parent) if ctx.context_id in born else None
                if parent is not None:  # a new child: its parent's options change (token drop)
                    self._executor.submit(self._placing.insert(parent))
            self._mover.publish_tier_state()
            if durable:
                await self._durable.write_through(kept)
        except BaseException:
            # Not acknowledged, so not stored: the client may put the same keys again.
            await self.delete([m.key for m in metas])
            raise
        return metas

    def _read_cards(self, recs: Sequence[AllocationRecord]) -> dict[str, ModelCard]:
        """The model cards of a commit, by allocation id, each parsed and checked before
        anything of the commit is stored: a bad one aborts the commit (its blocks back to the
        arena) with INVALID_ARGUMENT. A card that raised mid-commit leaked its arena block:
        46 of them and every tenant's put failed "arena full" (issue 27.2)."""
        cards: dict[str, ModelCard] = {}
        for rec in recs:
            if rec.meta.layout != MODEL_CARD_LAYOUT:
                continue
            try:
                card = ModelCard.from_bytes(bytes(self._cpu.view(rec.block)))
                cards[rec.allocation_id] = self._tenants_card(rec.meta, card, cards.values())
            except KvtierError as e:
                self._leases.abort([r.allocation_id for r in recs])
                raise type(e)(
                    f"object {rec.meta.key!r}: {e}; nothing of this commit was stored"
                ) from None
        return cards

    def _tenants_card(
        self, meta: ObjectMeta, card: ModelCard, others: Iterable[ModelCard]
    ) -> ModelCard:
        """``card`` under its tenant's name for the model (``<tenant>/<model>``, the name the
        tenant's LMCache keys carry): a tenant's card applies to its own contexts only. It
        was kept under the name the card gave, so tenant A's card for ``B/<model>`` rotated
        B's contexts, and B's own card never applied to them (issue 27.3). A tenant keeps at
        most MAX_CARDS_PER_TENANT cards; they count against its quota (``allocate``)."""
        prefix = f"{meta.tenant}/" if meta.tenant else ""
        if meta.key != prefix + model_card_key(card.model):
            raise InvalidArgumentError(
                f"a model card of {card.model[:200]!r} is put under the key "
                f"{model_card_key(card.model)[:200]!r}, not another"
            )
        owner = self._card_tenant(card.model)
        if not meta.tenant and owner:
            raise PermissionDeniedError(
                f"model {card.model[:200]!r} is in tenant {owner!r}'s namespace: the default "
                "tenant may not register cards for it"
            )
        name = prefix + card.model
        names = {c.model for c in others} | {n for n in self._model_cards if n != name}
        kept = sum(self._card_tenant(n) == meta.tenant for n in names)
        if kept >= MAX_CARDS_PER_TENANT:
            raise CapacityError(
                f"tenant {meta.tenant!r} keeps {kept} model cards; at most "
                f"{MAX_CARDS_PER_TENANT} (one per served model)"
            )
        return replace(card, model=name)

    def _verify_checksums(self, recs: Sequence[AllocationRecord]) -> None:
        """A checksum the client gave (xxh3_64 of the bytes; 0: none) must match what it
        wrote: one that does not is refused before anything of the commit is stored (a wrong
        one was accepted and served, and failed only when the object was written to SSD)."""
        for rec in recs:
            given = rec.meta.checksum
            if not given:
                continue
            actual = data_checksum(self._cpu.view(rec.block))
            if actual != given:
                self._leases.abort([r.allocation_id for r in recs])
                raise InvalidArgumentError(
                    f"object {rec.meta.key!r}: checksum {given:#x} given, but the bytes written "
                    f"hash to {actual:#x} (xxh3_64); nothing of this commit was stored: "
                    "allocate and write again"
                )

    async def put_bytes(
        self, meta: ObjectMeta, data: memoryview, durable: bool = False
    ) -> ObjectMeta:
        """Store bytes that arrived by stream (not through the arena)."""
        (rec,) = self.allocate([meta])
        try:
            self._cpu.view(rec.block)[:] = data
        except BaseException:
            self._leases.abort([rec.allocation_id])
            raise
        (stored,) = await self.commit([rec.allocation_id], durable)
        return stored

    def _add_object(self, meta: ObjectMeta, tier: str) -> ContextRecord:
        """Index a committed object; its context is placed by :meth:`_place_grown`."""
        computed = meta.context not in self._index.contexts
        ctx = self._index.add(ObjectRecord(meta, tier))
        ctx.last_access_s = time.monotonic()
        if computed:
            # A client stores a context the daemon does not hold: a request just computed it
            # (a first ask, or a miss after it was dropped). That request asked for the
            # context as much as a load does, so it counts in the context's frequency:
            # counting loads only, a dropped context never earned its way back in against
            # those the placer kept (EvicPress weighs every request, §4.2).
            self._profiling.note_access(ctx.context_id)
        ctx.durable_held = False  # the placer places the whole context again
        return ctx

    def _place_grown(self, ctx: ContextRecord, tier: str) -> None:
        """Tell the placer once per commit of a context that grew, not once per object: a put
        of a prompt's chunks is one commit, and placing each partial context in turn had the
        placer displace others for it, then bring them back as it grew (e2e run: 171 moves
        and 120 placements for 86 requests, most of them such round trips)."""
        self._profiling.note_change(ctx)
        self._executor.submit(self._joined(ctx, self._placing.insert(ctx), tier))

    def learn_card(self, meta: ObjectMeta, data: bytes) -> None:
        """A model card a plugin registered (a put of layout ``MODEL_CARD_LAYOUT``, kept in
        memory and in ``data_dir``, never as an object the placer would see): token-dropped
        variants of its model's contexts can now be written in the servable form.
        ``InvalidArgumentError`` for a card that is not valid."""
        self._keep_card(meta, self._tenants_card(meta, ModelCard.from_bytes(data), ()))

    def _keep_card(self, meta: ObjectMeta, card: ModelCard) -> None:
        """Keep a card :meth:`_tenants_card` named."""
        self._model_cards[card.model] = card
        self._card_sizes[card.model] = meta.size_bytes
        save_card(self._config.data_dir, card)
        self._profiling.options.changed()  # token-dropped variants may be servable now
        self._profiling.card_learned()  # the model cache may be the served model's checkpoint

    def _joined(self, ctx: ContextRecord, plan: Plan, tier: str) -> Plan:
        """``plan`` (the placer's answer to a context that grew), plus the operation that
        brings the new object in ``tier`` to where the context is placed: the placer plans
        none for a context it leaves where it is, yet the new object is not there yet."""
        if any(op.context_id == ctx.context_id for op in plan.operations):
            return plan  # a move or drop of the context takes every object of it along
        target = self._placing.target(ctx.context_id)
        if target.tier == tier and target.variant == ctx.variant:
            return plan
        kind = OpKind.DROP if target.dropped else OpKind.MOVE
        source = Placement(ctx.variant, tier)
        return plan + Plan((Operation(kind, ctx.context_id, source, target, "joins its context"),))

    # -- removal -----------------------------------------------------------------------------

    async def delete(self, keys: Sequence[str], tenant: str | None = None) -> int:
        """Delete objects (only ``tenant``'s when given: a client's delete)."""
        deleted = 0
        index = self._index
        for key in keys:
            obj = index.objects.get(key) if tenant is None else index.owned(key, tenant)
            if obj is None:
                continue
            ctx = index.contexts[obj.meta.context]
            async with ctx.lock:
                if key in index.objects:
                    await self._mover.remove_object_bytes(index.objects[key])
                    self._mover.forget_object(key)
                    deleted += 1
                if ctx.context_id not in index.contexts:
                    await self._mover.drop_extras(ctx)
        return deleted
