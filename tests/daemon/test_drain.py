"""``drain`` empties a tier even while the placer's plans are on their way (in-process engine,
real tiers, the ``lru`` placer).

A put lands in the arena and the placer's ``place`` into the fastest tier runs later, on the
executor; a read queues a ``promoted on access`` move the same way. A drain that only looks at
where the bytes are now misses what such a queued operation brings into the tier right after
it returned (the gpu-check run of issue 31 found an object still served from the gpu tier after
``drain("gpu")``). The fast tier here is an ssd-kind tier on top, so the test runs without CUDA.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvtierd.config import DaemonConfig, TierConfig
from kvtierd.engine import Engine
from kvtierd.policies.loader import parse_policy
from kvtierd.types import ObjectMeta

SIZE = 64 << 10


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    tiers = (
        TierConfig("fast", "ssd", 16 * SIZE, str(tmp_path / "fast")),
        TierConfig("cpu", "cpu", 16 * SIZE, options={"staging_bytes": "8MiB"}),
        TierConfig("ssd", "ssd", 64 * SIZE, str(tmp_path / "ssd")),
    )
    config = DaemonConfig(
        socket_path=str(tmp_path / "s"), data_dir=str(tmp_path / "data"), tiers=tiers
    )
    e = Engine(config)
    await e.start()
    await e.apply_policy(parse_policy("placer: lru\n", "lru.yaml"))
    yield e
    await e.close()


async def _put(engine: Engine, key: str) -> None:
    (rec,) = engine.allocate([ObjectMeta(key=key, size_bytes=SIZE, context_id=key)])
    engine.cpu.view(rec.block)[:] = bytes([7]) * SIZE
    await engine.commit([rec.allocation_id])


async def test_drain_waits_for_a_queued_place_into_the_tier(engine: Engine) -> None:
    await _put(engine, "h")
    assert engine.executor.pending, "the place into 'fast' is still queued"
    moved, dropped = await engine.drain("fast")
    await engine.executor.idle()
    assert engine.objects["h"].tier == "cpu"
    assert (moved, dropped) == (1, 0)
    assert engine.placing.placer.placement("h").tier == "cpu"  # the placer agrees


async def test_drain_waits_for_a_queued_promotion(engine: Engine) -> None:
    await _put(engine, "a")
    await engine.executor.idle()
    assert await engine.drain("fast") == (1, 0)
    engine.release([lease.lease_id for lease in await engine.get(["a"])])  # promotes it back
    assert engine.executor.pending
    assert await engine.drain("fast") == (1, 0)
    await engine.executor.idle()
    assert engine.objects["a"].tier == "cpu"
