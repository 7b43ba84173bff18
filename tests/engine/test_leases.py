"""The table of allocations and leases, in process over a real CPU tier (its arena)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kvtierd.config import TierConfig
from kvtierd.engine.leases import LeaseTable
from kvtierd.errors import AlreadyExistsError, InvalidArgumentError, LeaseError, NotFoundError
from kvtierd.storage import CpuTier
from kvtierd.types import ObjectMeta


@pytest.fixture
async def cpu() -> AsyncIterator[CpuTier]:
    tier = CpuTier(TierConfig("cpu", "cpu", 1 << 20, options={"staging_bytes": "1MiB"}))
    await tier.start()
    yield tier
    await tier.close()


def _meta(key: str, size: int = 4096, tenant: str = "") -> ObjectMeta:
    return ObjectMeta(key=key, size_bytes=size, context_id="c", tenant=tenant)


def _table(cpu: CpuTier) -> LeaseTable:
    return LeaseTable("inst", cpu, {cpu.name: cpu})


async def test_allocations_stage_blocks_and_abort_frees_them(cpu: CpuTier) -> None:
    table = _table(cpu)
    before = cpu.arena.allocator.free_bytes
    recs = table.allocate([_meta("a"), _meta("b", tenant="t")], timeout_s=60)
    assert [r.allocation_id for r in recs] == ["inst:a1", "inst:a2"]
    assert table.allocating("a") and not table.allocating("z")
    assert table.in_flight_bytes() == {"": 4096, "t": 4096}
    table.abort([r.allocation_id for r in recs])
    assert not table.allocations and cpu.arena.allocator.free_bytes == before


async def test_a_commit_names_each_allocation_once_and_only_once(cpu: CpuTier) -> None:
    table = _table(cpu)
    (rec,) = table.allocate([_meta("a")], timeout_s=60)
    with pytest.raises(InvalidArgumentError, match="listed twice"):
        table.to_commit([rec.allocation_id, rec.allocation_id])
    assert table.to_commit([rec.allocation_id]) == [rec]
    table.committed(rec)
    with pytest.raises(AlreadyExistsError, match="already committed"):
        table.to_commit([rec.allocation_id])
    with pytest.raises(NotFoundError, match="allocate again"):
        table.to_commit(["inst:a99"])
    cpu.free_block(rec.block)


async def test_a_staged_block_is_freed_by_its_last_release(cpu: CpuTier) -> None:
    table = _table(cpu)
    before = cpu.arena.allocator.free_bytes
    block = cpu.stage(4096)
    first = table.lease(_meta("a"), "ssd", cpu.name, block, 30, staged=True)
    second = table.lease(_meta("a"), "ssd", cpu.name, block, 30)
    assert table.busy
    table.release([first.lease_id])
    assert cpu.arena.allocator.free_bytes < before  # still leased
    table.release([second.lease_id])
    assert cpu.arena.allocator.free_bytes == before and not table.busy


async def test_a_block_discarded_under_a_lease_waits_for_the_release(cpu: CpuTier) -> None:
    table = _table(cpu)
    before = cpu.arena.allocator.free_bytes
    block = cpu.stage(4096)
    lease = table.lease(_meta("a"), cpu.name, cpu.name, block, 30)
    table.discard(cpu.name, block)  # the object was moved or deleted meanwhile
    assert cpu.arena.allocator.free_bytes < before
    table.release([lease.lease_id])
    assert cpu.arena.allocator.free_bytes == before
    other = cpu.stage(4096)
    table.discard(cpu.name, other)  # no lease on it: freed at once
    assert cpu.arena.allocator.free_bytes == before


async def test_releases_say_why_a_lease_is_unknown(cpu: CpuTier) -> None:
    table = _table(cpu)
    with pytest.raises(LeaseError, match="previous daemon instance"):
        table.release(["old:l1"])
    with pytest.raises(NotFoundError, match="already released"):
        table.release(["inst:l7"])


async def test_reap_expires_leases_and_allocations(cpu: CpuTier) -> None:
    table = _table(cpu)
    before = cpu.arena.allocator.free_bytes
    table.allocate([_meta("a")], timeout_s=1)
    table.lease(_meta("b"), "ssd", cpu.name, cpu.stage(4096), 1, staged=True)
    table.reap(now_s=0.0)
    assert table.allocations and table.leases  # not yet
    table.reap(now_s=float("inf"))
    assert not table.allocations and not table.leases
    assert cpu.arena.allocator.free_bytes == before
