"""The index after a restart: every object the persistent tiers still hold, found where it
lives, and each context handed to the placer where it is."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kvtierd.engine.context_kv import client_key
from kvtierd.engine.executor import Executor
from kvtierd.engine.index import ContextIndex, found_order
from kvtierd.engine.mover import TierMover
from kvtierd.engine.placing import Placing
from kvtierd.engine.state import ObjectRecord
from kvtierd.engine.variant_writer import settle_variants
from kvtierd.errors import KvtierError
from kvtierd.storage import Tier
from kvtierd.types import ObjectMeta

logger = logging.getLogger(__name__)


async def rebuild_index(
    index: ContextIndex,
    tiers: Mapping[str, Tier],
    mover: TierMover,
    executor: Executor,
    placing: Placing,
) -> None:
    """Index every object ``tiers`` still hold (after a restart); the placer adopts each
    context where it is, through ``executor`` (many in the background: ``Placing.adopt_found``)."""
    found: list[tuple[ObjectMeta, str]] = []
    for tier in tiers.values():
        try:
            found.extend((meta, tier.name) for meta in tier.metas())
        except KvtierError as e:
            # A shared tier that is down at start is not fatal: its objects are found
            # on demand (``ReadPath._fetch_shared``) once it is back.
            logger.warning("tier %s: cannot list objects at start: %s", tier.name, e)
    # Each context's objects in the order they were put: tiers list them in scan order.
    found.sort(key=lambda item: found_order(item[0]))
    settled = await settle_variants(found, tiers, mover.reference_tier())
    for meta, tier_name in settled.objects:
        key = client_key(meta.key)
        if key in index.objects:
            logger.warning("object %r found in two tiers; keeping one copy", key)
            continue
        # Found on persistent storage: keep it persistent; one committed durable is
        # protected again until read (the daemon does not know whether it was before).
        record = ObjectRecord(meta, tier_name, durable=True, unread=meta.durable)
        index.add(record, key, found=True)
    index.relink()  # a child found before its parent
    for ctx in index.contexts.values():
        ctx.marker = settled.markers.get(ctx.context_id)
        if ctx.marker is not None:
            index.marker_owner[ctx.marker[0].key] = ctx.context_id
        ctx.reference = settled.references.get(ctx.context_id)
        for meta, where in ctx.reference or ():
            index.account(meta, where, +1)
        if ctx.marker is not None:
            index.account(ctx.marker[0], ctx.marker[1], +1)
    placing.adopt_found(list(index.contexts.values()), executor.submit)
    if index.objects:
        logger.info("rebuilt index: %d objects in %d contexts", len(index.objects),
                    len(index.contexts))  # fmt: skip
