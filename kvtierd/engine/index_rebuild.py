"""The index after a restart: every object the persistent tiers still hold, found where it
lives, and each context handed to the placer where it is.

A restart indexes every object the persistent tiers hold before the daemon serves (issue 42:
1,000,000 objects within 30 s), so what :meth:`ContextIndex.add` does per object is done here
once per restart where it can be: the bytes are charged in one sum per (tenant, tier), and only
contexts whose objects name a parent are linked. (``Engine.start`` keeps the cyclic garbage
collector waiting over the whole start: each full collection would walk the growing index.)
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from operator import attrgetter

from kvtierd.engine.context_kv import SEPARATOR, client_key
from kvtierd.engine.executor import Executor
from kvtierd.engine.index import ContextIndex
from kvtierd.engine.mover import TierMover
from kvtierd.engine.placing import Placing
from kvtierd.engine.state import ContextRecord, ObjectRecord
from kvtierd.engine.variant_writer import Settled, made_or_marking, settle_variants
from kvtierd.errors import KvtierError
from kvtierd.storage import Tier
from kvtierd.types import ObjectMeta

logger = logging.getLogger(__name__)


async def rebuild_index(index: ContextIndex, tiers: Mapping[str, Tier], mover: TierMover) -> None:
    """Index every object ``tiers`` still hold (after a restart); the placer adopts the
    contexts after (:func:`adopt_found`)."""
    await _index_found(index, tiers, mover)  # (the collector waits: Engine.start)
    if index.objects:
        logger.info("rebuilt index: %d objects in %d contexts", len(index.objects),
                    len(index.contexts))  # fmt: skip


def adopt_found(
    index: ContextIndex, executor: Executor, placing: Placing, access_times_restored: bool
) -> None:
    """The placer adopts each context found at start where it is, through ``executor`` (many
    in the background: ``Placing.adopt_found``), the least recently accessed first where the
    last stop saved access times: an LRU placer ranks a context it adopts most recent, so
    adopted in index order its order after a restart was the keys' (the one a rebalance would
    restore, once, from ``last_access_s``)."""
    found = list(index.contexts.values())
    if access_times_restored:
        found.sort(key=attrgetter("last_access_s"))
    placing.adopt_found(found, executor.submit)


async def _index_found(index: ContextIndex, tiers: Mapping[str, Tier], mover: TierMover) -> None:
    """Index what the tiers list, leftovers of compressions cut short deleted first."""
    found: list[tuple[ObjectMeta, str]] = []
    for tier in tiers.values():
        try:
            found.extend((meta, tier.name) for meta in tier.metas())
        except KvtierError as e:
            # A shared tier that is down at start is not fatal: its objects are found
            # on demand (``ReadPath._fetch_shared``) once it is back.
            logger.warning("tier %s: cannot list objects at start: %s", tier.name, e)
    # The objects settle_variants looks at again, picked out in the order the tiers list them
    # (a pass in key order met each meta at another place in memory: 5x as long at 1M).
    picked = made_or_marking(found)
    # Each context's objects in the order they were put: tiers list them in scan order.
    sort_found(found)
    sort_found(picked)
    settled = await settle_variants(found, picked, tiers, mover.reference_tier())
    add_found(index, settled.objects)
    add_variants(index, settled)


def sort_found(found: list[tuple[ObjectMeta, str]]) -> None:
    """Sort ``found`` by :func:`~kvtierd.engine.index.found_order` of each meta, as two stable
    sorts of one plain key each (the key, then the position, an object without one first:
    positions are >= 0, ``ssd_format.check_position_field``). Python compares a list of plain
    ``str`` or small ``int`` keys without a tuple per object: 2-3x faster at 100,000. The
    second sort is left out when every object has one position (one-object contexts: each
    its first): its pass, in key order, met each meta at another place in memory (0.4 s at
    1,000,000; the positions are read first in the order the tiers list them, ~0.1 s)."""
    positions = {item[0].position for item in found}
    found.sort(key=lambda item: item[0].key)
    if len(positions) > 1:
        found.sort(key=lambda item: -1 if item[0].position is None else item[0].position)


def add_found(index: ContextIndex, found: Iterable[tuple[ObjectMeta, str]]) -> None:
    """:meth:`ContextIndex.add` of every object found on a persistent tier (in :func:`sort_found`
    order; a key found in two tiers is indexed once), with their bytes charged per (tenant,
    tier) at the end and their contexts linked to the parents they name
    (:meth:`ContextIndex.relink`).

    The first object of a context that names no parent, in an index without namespaces (every
    context of a restart of one-object contexts), makes its context here, as
    :meth:`ContextIndex.context_add` would (its one key in its ``held_keys``), without its
    calls: 6.3 s of a 1,000,000-object restart was this loop, ~2 us an object of it those
    calls."""
    objects, contexts = index.objects, index.contexts
    plain = not index.namespace_quotas  # (else a new context's namespace is looked up)
    charged: dict[str, list[ObjectMeta]] = {}  # tier -> the objects indexed there
    named: dict[str, str] = {}  # context -> the parent its first object naming one names
    for meta, tier in found:
        key = meta.key
        if SEPARATOR in key:
            key = client_key(key)
        if key in objects:
            logger.warning("object %r found in two tiers; keeping one copy", key)
            continue
        # Found on persistent storage: keep it persistent; one committed durable is
        # protected again until read (the daemon does not know whether it was before).
        objects[key] = ObjectRecord(meta, tier, "", True, meta.durable)
        context_id = meta.context_id or meta.key  # meta.context
        parent = meta.parent_context_id
        if plain and not parent and context_id not in contexts:
            position = meta.position
            contexts[context_id] = ContextRecord(
                context_id, meta.variant, meta.tenant, held_keys=key, size_bytes=meta.size_bytes,
                next_position=0 if position is None else position + 1,
            )  # fmt: skip
        else:
            ctx = index.context_add(meta, key)
            if parent and not ctx.parent:
                named.setdefault(ctx.context_id, parent)
        charged.setdefault(tier, []).append(meta)
    for tier, metas in charged.items():
        charge(index, metas, tier)
    index.relink(named)  # a child found before its parent


def charge(index: ContextIndex, metas: list[ObjectMeta], tier: str) -> None:
    """:meth:`ContextIndex.account` of ``metas`` in ``tier``, in one sum per tenant when no
    tenant has namespaces (a ``(tenant, tier)`` key per object was 0.8 s of 100,000)."""
    if any(index.namespace_quotas.values()):
        for meta in metas:
            index.account(meta, tier, +1)
        return
    per_tenant: Counter[str] = Counter()
    for meta in metas:
        per_tenant[meta.tenant] += meta.size_bytes
    for tenant, nbytes in per_tenant.items():
        index.usage[tenant, tier] += nbytes


def add_variants(index: ContextIndex, settled: Settled) -> None:
    """Give each context the marker of its daemon-made variant and the reference copy of its
    original that the tiers hold (the contexts that have none keep ``None``), and charge them."""
    for context_id, marker in settled.markers.items():
        ctx = index.contexts.get(context_id)
        if ctx is None:
            continue
        ctx.marker = marker
        index.marker_owner[marker[0].key] = context_id
        index.account(marker[0], marker[1], +1)
    for context_id, reference in settled.references.items():
        ctx = index.contexts.get(context_id)
        if ctx is None:
            continue
        ctx.reference = reference
        for meta, where in reference:
            index.account(meta, where, +1)
