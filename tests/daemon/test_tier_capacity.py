"""A tier's ``capacity`` holds under the LMCache plugin's traffic (in-process engine, real
tiers, real executor, the ``lru`` placer).

The plugin stores a context's chunks in one Allocate/Commit, and later requests may add chunks
to it; every lookup holds what it finds (``hold_s``) for the load. The tier sizes are those of
the end-to-end run that found the defect, in chunks: the CPU tier holds 2.2, the SSD tier 8.8;
contexts are 3 and 7 chunks. While a hold defers the drop of a context the placer evicted, a
tier may hold that context besides its capacity; otherwise each tier holds at most its capacity
on the device (SSD: the files in its directory; CPU: the arena bytes of its objects) and every
context is where the placer has it. Once the holds end, nothing is left over.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from kvtierd.config import DaemonConfig, TierConfig
from kvtierd.engine import Engine
from kvtierd.policy_config import parse_policy
from kvtierd.types import ObjectMeta

CHUNK = 64 << 10
CPU_CAP = CHUNK * 22 // 10  # 12,976,128 bytes for chunks of 5,902,336 in the e2e run
SSD_CAP = CHUNK * 88 // 10  # 51,904,512 bytes
HOLD_S = 2.0  # the plugin's kvtierd.hold_s is 30 s; the test waits for the holds to end


def _config(tmp: Path) -> DaemonConfig:
    tiers = (
        TierConfig("cpu", "cpu", CPU_CAP, options={"staging_bytes": "8MiB"}),
        TierConfig("ssd", "ssd", SSD_CAP, str(tmp / "ssd")),
    )
    return DaemonConfig(socket_path=str(tmp / "s"), data_dir=str(tmp / "data"), tiers=tiers)


@pytest.fixture
async def engine(tmp_path: Path):
    e = Engine(_config(tmp_path))
    await e.start()
    await e.apply_policy(parse_policy("placer: lru\n", "lru.yaml"))
    yield e
    await e.close()


def _meta(cid: str, key: str) -> ObjectMeta:
    return ObjectMeta(key=key, size_bytes=CHUNK, context_id=cid, token_count=256)


async def _request(engine: Engine, cid: str, chunks: int) -> None:
    """What the plugin does for one prompt: a pinned lookup of its chunks, a load of the
    prefix found, then one Allocate/Commit of the chunks missing (they join the context)."""
    keys = [f"{cid}/{i}" for i in range(chunks)]
    _, hits = await engine.lookup(keys, hold_s=HOLD_S)
    if hits:
        leases = await engine.get(keys[:hits])
        engine.release([lease.lease_id for lease in leases])
    missing = [k for k in keys if k not in engine.objects]
    if missing:
        records = engine.allocate([_meta(cid, k) for k in missing])
        for rec in records:
            engine.cpu.view(rec.block)[:] = bytes([len(rec.meta.key) % 251]) * CHUNK
        await engine.commit([rec.allocation_id for rec in records])


def _ssd_files(engine: Engine) -> int:
    return len(list((Path(engine.config.tiers[1].path) / "objects").rglob("*.kvt")))


def _check(engine: Engine, step: str) -> None:
    """The tiers' bytes against their capacities and the placer's view (module docstring)."""
    pending = {op.context_id for op in engine.executor.deferred}
    device = {"cpu": engine.cpu.used_bytes(), "ssd": engine.tiers["ssd"].used_bytes()}
    files = _ssd_files(engine)  # each a chunk plus a header: the device holds what is indexed
    assert files == engine.tiers["ssd"].object_count(), f"{step}: {files} files on ssd"
    placed = {"cpu": 0, "ssd": 0}
    for ctx in engine.contexts.values():
        tiers = {engine.objects[k].tier for k in ctx.keys}
        assert len(tiers) == 1, f"{step}: context {ctx.context_id} split over {tiers}"
        (tier,) = tiers
        if ctx.context_id in pending:
            continue  # evicted, kept while held
        try:
            target = engine.placing.placer.placement(ctx.context_id).tier
        except KeyError:
            target = None  # the lru placer forgets what it drops
        assert tier == target, f"{step}: {ctx.context_id} is in {tier}, the placer says {target}"
        placed[tier] += ctx.size_bytes
    for tier, cap in (("cpu", CPU_CAP), ("ssd", SSD_CAP)):
        assert placed[tier] <= cap, f"{step}: {tier} holds {placed[tier]} placed > {cap}"
        held = device[tier] - placed[tier]
        assert held == sum(
            c.size_bytes for c in engine.contexts.values()
            if c.context_id in pending and engine.objects[next(iter(c.keys))].tier == tier
        ), f"{step}: {tier} holds {held} bytes neither placed nor held"  # fmt: skip


async def _holds_ended(engine: Engine, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (
        engine.executor.deferred
        or engine.executor.pending
        or any(c.hold_until_s > time.monotonic() for c in engine.contexts.values())
    ):
        assert time.monotonic() < deadline, (
            f"deferred operations never ran: {engine.executor.deferred}"
        )
        await asyncio.sleep(0.05)


async def test_capacity_holds_under_plugin_traffic(engine: Engine) -> None:
    # "x" grows by a chunk (a prompt that continues it) while its lookup holds it; then, as in
    # the e2e run, a 7-chunk context is asked again and again while 3-chunk ones arrive, and
    # "a" grows too while an evicted, held copy of it is still there.
    requests = [("x", 3), ("x", 4), ("a", 7), ("a", 7), ("b", 3), ("a", 7), ("c", 3),
                ("a", 8), ("d", 3), ("b", 3), ("e", 3), ("a", 8), ("c", 3)]  # fmt: skip
    for i, (cid, chunks) in enumerate(requests):
        await _request(engine, cid, chunks)
        await engine.executor.idle()
        while engine.executor.pending:  # a hold ended meanwhile: its wake-up is running
            await engine.executor.idle()
        _check(engine, f"request {i} ({cid})")
    await _holds_ended(engine)
    _check(engine, "after the holds")
    assert not engine.executor.deferred
    assert engine.tiers["ssd"].used_bytes() <= SSD_CAP
