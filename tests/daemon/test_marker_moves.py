"""The order a move writes a compressed context in (in-process engine, real tiers).

A restart takes a daemon-made variant as complete when it finds its marker on a persistent
tier (engine/variant_writer.py). So a move must write the marker to a persistent tier only after
every object the marker covers is there, and take it off a persistent tier before the objects
leave it: a crash in the move then leaves either the old copy or a complete new one, never a
part that the restart takes for the whole. ``tests/storage/test_compressed_moves.py`` checks
what a restart finds after each path that moves a compressed context (a plan, a drain, the
shutdown flush); this file checks the order, and what a restart does with the two markers a
crash between writing the new one and deleting the old one leaves.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from kvtierd.config import DaemonConfig, TierConfig
from kvtierd.engine import Engine
from kvtierd.engine.context_kv import MARKER_LAYOUT
from kvtierd.policies.loader import parse_policy
from kvtierd.storage import Tier, create_tier
from kvtierd.types import ObjectMeta
from tests.daemon.test_profiling_engine import _put_context

VARIANTS = ["int8", "knorm@0.5"]  # a quantized variant and a token-dropped one


def _config(tmp: Path) -> DaemonConfig:
    tiers = (
        TierConfig("cpu", "cpu", 1 << 20, options={"staging_bytes": "32MiB"}),
        TierConfig("ssd", "ssd", 64 << 20, str(tmp / "ssd")),
        TierConfig("ssd2", "ssd", 64 << 20, str(tmp / "ssd2")),  # a second persistent tier
    )
    return DaemonConfig(socket_path=str(tmp / "s"), data_dir=str(tmp / "data"), tiers=tiers)


async def _engine(tmp: Path) -> Engine:
    e = Engine(_config(tmp))
    await e.start()
    await e.apply_policy(parse_policy("placer: lru\n", "lru.yaml"))
    return e


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    e = await _engine(tmp_path)
    yield e
    await e.close()


async def _compressed_in_cpu(engine: Engine, variant: str) -> str:
    await _put_context(engine, "doc")
    await engine.apply_policy(parse_policy(f"placer: fixed\nvariant: {variant}\n", "f.yaml"))
    await engine.executor.idle()
    ctx = engine.contexts["doc"]
    assert ctx.variant == variant and ctx.marker is not None
    assert {engine.objects[k].tier for k in ctx.keys} == {"cpu"} and ctx.marker[1] == "cpu"
    return ctx.marker[0].key


def _record(tier: Tier, name: str, log: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Log the keys ``tier``'s method ``name`` is called with, in order."""
    real: Callable[..., Awaitable[Any]] = getattr(tier, name)

    async def recorded(meta_or_key: ObjectMeta | str, *args: Any, **kwargs: Any) -> Any:
        log.append(meta_or_key if isinstance(meta_or_key, str) else meta_or_key.key)
        return await real(meta_or_key, *args, **kwargs)

    monkeypatch.setattr(tier, name, recorded)


def _markers(tier: Tier) -> list[str]:
    return [m.key for m in tier.metas() if m.layout == MARKER_LAYOUT]


@pytest.mark.parametrize("variant", VARIANTS)
async def test_the_marker_is_written_after_every_object(engine, variant, monkeypatch):
    marker = await _compressed_in_cpu(engine, variant)
    objects = {engine.objects[k].meta.key for k in engine.contexts["doc"].keys}
    puts: list[str] = []
    _record(engine.tiers["ssd"], "put", puts, monkeypatch)
    assert await engine.drain("cpu") == (1, 0)
    assert puts[-1] == marker and sorted(puts[:-1]) == sorted(objects)  # the marker last
    assert engine.contexts["doc"].marker[1] == "ssd"
    assert _markers(engine.tiers["ssd"]) == [marker]
    assert not engine.cpu.contains(marker)  # its copy in the CPU tier is gone


@pytest.mark.parametrize("variant", VARIANTS)
async def test_a_promotion_takes_the_marker_off_disk_first(engine, variant, monkeypatch):
    """Moved up from the SSD tier (objects the daemon wrote there itself, not durable: the
    move leaves no copy behind), the marker leaves the SSD tier before any object does: a
    crash in between leaves objects without a marker there, which the restart deletes."""
    marker = await _compressed_in_cpu(engine, variant)
    await engine.drain("cpu")
    deletes: list[str] = []
    _record(engine.tiers["ssd"], "delete", deletes, monkeypatch)
    ctx = engine.contexts["doc"]
    await engine.mover.move_context(ctx, "cpu")
    assert deletes[0] == marker and len(deletes) == 1 + len(ctx.keys)
    assert ctx.marker[1] == "cpu" and _markers(engine.tiers["ssd"]) == []


@pytest.mark.parametrize("variant", VARIANTS)
async def test_two_markers_left_by_a_crash_leave_one(tmp_path, variant):
    """A crash between writing the marker to the new tier and deleting it from the old one
    leaves two; the restart keeps the context and deletes one, so that no stray marker can
    later pass a compression cut short off as complete."""
    engine = await _engine(tmp_path)
    marker = await _compressed_in_cpu(engine, variant)
    for tier in ("cpu", "ssd"):
        await engine.drain(tier)
    ctx = engine.contexts["doc"]
    keys = list(ctx.keys)
    meta, where = ctx.marker
    assert where == "ssd2"
    data = await engine.mover.copy_out(engine.index.record_of(marker))
    await engine.close()
    ssd = create_tier(_config(tmp_path).tier("ssd"))  # the old copy, as the crash left it
    await ssd.start()
    await ssd.put(meta, memoryview(data))
    await ssd.close()
    engine = await _engine(tmp_path)
    try:
        ctx = engine.contexts["doc"]
        assert (ctx.variant, list(ctx.keys)) == (variant, keys)
        found = _markers(engine.tiers["ssd"]) + _markers(engine.tiers["ssd2"])
        assert found == [marker]
        assert ctx.marker[0].key == marker
    finally:
        await engine.close()
