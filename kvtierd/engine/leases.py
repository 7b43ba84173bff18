"""The table of puts in flight (allocations: staged arena blocks a client is writing) and of
reads in flight (leases: a reader's claim on a block). A lease references its block; a block
no tier owns any more (the object was moved or deleted meanwhile, or it is a copy staged from a
slower tier) is freed by the last release."""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence

from kvtierd.engine.state import AllocationRecord, LeaseRecord
from kvtierd.errors import AlreadyExistsError, InvalidArgumentError, LeaseError, NotFoundError
from kvtierd.storage import CpuTier, Tier
from kvtierd.storage.allocator import Block
from kvtierd.storage.pooled import PooledTier
from kvtierd.types import ObjectMeta

logger = logging.getLogger(__name__)

MAX_REMEMBERED_COMMITS = 100_000
"""Committed allocation ids kept to refuse a double commit (the oldest are forgotten)."""


class LeaseTable:
    """Allocations and leases of one daemon instance (ids carry ``instance_id``, so a lease
    from before a restart is told apart from an unknown one)."""

    def __init__(self, instance_id: str, cpu: CpuTier, pools: Mapping[str, Tier]) -> None:
        self.instance_id = instance_id
        self._cpu = cpu
        self._pools = pools  # tier name -> tier; a lease's pool is one of the pooled ones
        self.allocations: dict[str, AllocationRecord] = {}
        self.leases: dict[str, LeaseRecord] = {}
        self._committed: OrderedDict[str, None] = OrderedDict()  # recent ids: double commits
        # (pool tier, offset) -> leases on that block; blocks no tier owns any more, freed by
        # their last release. The pool is the CPU tier's arena, or a gpu tier (device leases).
        self._block_refs: dict[tuple[str, int], int] = {}
        self._orphans: dict[tuple[str, int], Block] = {}
        self._ids = itertools.count(1)
        for name, tier in pools.items():
            if isinstance(tier, PooledTier):  # a block leased in place is never compacted
                tier.check_leases_with(functools.partial(self._leased, name))

    @property
    def busy(self) -> bool:
        """A client still reads under a lease."""
        return bool(self.leases)

    # -- allocations ---------------------------------------------------------------------------

    def allocate(
        self, metas: Sequence[ObjectMeta], timeout_s: float, keep_reserve: bool = True
    ) -> list[AllocationRecord]:
        """Stage an arena block per object (all or none; ``CpuTier.stage_put``)."""
        records: list[AllocationRecord] = []
        try:
            for meta in metas:
                block = self._cpu.stage_put(meta.size_bytes, keep_reserve)
                now = time.monotonic()
                rec = AllocationRecord(
                    allocation_id=f"{self.instance_id}:a{next(self._ids)}",
                    meta=meta,
                    block=block,
                    deadline_s=now + timeout_s,
                    created_s=now,
                )
                self.allocations[rec.allocation_id] = rec
                records.append(rec)
        except BaseException:
            self.abort([rec.allocation_id for rec in records])
            raise
        return records

    def allocating(self, key: str) -> bool:
        return any(a.meta.key == key for a in self.allocations.values())

    def in_flight_bytes(self) -> Counter[str]:
        """Bytes being put, per tenant (they count against its quota)."""
        out: Counter[str] = Counter()
        for a in self.allocations.values():
            out[a.meta.tenant] += a.meta.size_bytes
        return out

    def abort(self, allocation_ids: Sequence[str]) -> None:
        for aid in allocation_ids:
            rec = self.allocations.pop(aid, None)
            if rec is not None:
                self._cpu.free_block(rec.block)

    def to_commit(self, allocation_ids: Sequence[str]) -> list[AllocationRecord]:
        """The allocations a commit names, each once, none committed before."""
        if len(set(allocation_ids)) < len(allocation_ids):
            twice = next(aid for aid, n in Counter(allocation_ids).items() if n > 1)
            raise InvalidArgumentError(f"allocation {twice!r} is listed twice; list each once")
        recs: list[AllocationRecord] = []
        for aid in allocation_ids:
            if aid in self._committed:
                raise AlreadyExistsError(f"allocation {aid!r} was already committed")
            if aid not in self.allocations:
                raise NotFoundError(f"unknown or expired allocation {aid!r}; allocate again")
            recs.append(self.allocations[aid])
        return recs

    def committed(self, rec: AllocationRecord) -> None:
        """The allocation's block now belongs to a tier (or was freed): it is done."""
        del self.allocations[rec.allocation_id]
        self._committed[rec.allocation_id] = None
        if len(self._committed) > MAX_REMEMBERED_COMMITS:
            self._committed.popitem(last=False)

    # -- leases --------------------------------------------------------------------------------

    def lease(
        self, meta: ObjectMeta, tier: str, pool: str, block: Block, lease_s: float, *,
        staged: bool = False,
    ) -> LeaseRecord:  # fmt: skip
        """A lease on ``block`` of ``pool``; a ``staged`` block (a copy no tier owns) is freed
        by the last release."""
        if staged:
            self._orphans[pool, block.offset] = block
        ref = (pool, block.offset)
        self._block_refs[ref] = self._block_refs.get(ref, 0) + 1
        lease = LeaseRecord(
            f"{self.instance_id}:l{next(self._ids)}", meta, tier, block,
            time.monotonic() + lease_s, pool,
        )  # fmt: skip
        self.leases[lease.lease_id] = lease
        return lease

    def _leased(self, pool: str, offset: int) -> bool:
        return (pool, offset) in self._block_refs

    def release(self, lease_ids: Sequence[str]) -> None:
        for lid in lease_ids:
            lease = self.leases.pop(lid, None)
            if lease is None:
                if not lid.startswith(self.instance_id + ":"):
                    raise LeaseError(
                        f"lease {lid!r} is from a previous daemon instance (it restarted); "
                        "get the object again"
                    )
                raise NotFoundError(f"unknown, expired or already released lease {lid!r}")
            self._unref(lease.pool, lease.block)

    def discard(self, pool: str, block: Block) -> None:
        """A block of ``pool`` no object owns any more: freed now, or by its last release."""
        if self._block_refs.get((pool, block.offset)):
            self._orphans[pool, block.offset] = block
        else:
            self._pooled(pool).free_block(block)

    def _unref(self, pool: str, block: Block) -> None:
        ref = (pool, block.offset)
        left = self._block_refs[ref] - 1
        if left:
            self._block_refs[ref] = left
            return
        del self._block_refs[ref]
        orphan = self._orphans.pop(ref, None)
        if orphan is not None:
            self._pooled(pool).free_block(orphan)

    def _pooled(self, pool: str) -> PooledTier:
        tier = self._pools[pool]
        if not isinstance(tier, PooledTier):
            raise TypeError(f"tier {pool!r} ({tier.kind}) holds no blocks to lease")
        return tier

    # -- expiry --------------------------------------------------------------------------------

    def reap(self, now_s: float) -> None:
        """Expire leases and abandoned allocations (a client that died mid-put)."""
        for lid in [lid for lid, lease in self.leases.items() if lease.deadline_s < now_s]:
            logger.warning("lease %s on %r expired unreleased", lid, self.leases[lid].meta.key)
            self.release([lid])
        for aid in [a for a, rec in self.allocations.items() if rec.deadline_s < now_s]:
            logger.warning("allocation %s for %r expired uncommitted", aid,
                           self.allocations[aid].meta.key)  # fmt: skip
            self.abort([aid])
