"""First profiles take the settled backlog a batch at a time (issue 42): while puts outran
profiling, every round (five a second) listed every settled context — half a million at 1M
puts — to profile the first few, and listed none at all while the arena had no room. A
context with no chunk layout never joins the backlog: it is said not profiled at its put."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from kvtierd.engine import Engine
from kvtierd.engine.context_options import NO_LAYOUT
from kvtierd.engine.profiling import profiling_service
from kvtierd.types import ObjectMeta
from tests.daemon.test_profiling_engine import _config


async def test_a_round_takes_at_most_a_batch_and_none_while_the_arena_is_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(profiling_service, "FIRST_BATCH", 3)
    engine = Engine(_config(tmp_path))
    await engine.start()
    service = engine.profiling
    assert service._task is not None
    service._task.cancel()  # the test runs the rounds itself
    with contextlib.suppress(asyncio.CancelledError):
        await service._task
    try:
        for i in range(8):  # no chunk layout: each is said not profiled at its put
            meta = ObjectMeta(f"k{i}", 16, f"c{i}")
            await engine.put_bytes(meta, memoryview(bytes(16)))
        assert not service._changed
        assert service.not_profiled.counts[NO_LAYOUT] == 8
        for i in range(8):  # asked for anyway (a split context is): each is looked at again
            service.schedule(f"c{i}")
        for cid in service._changed:
            service._changed[cid] = 0.0  # settled long ago
        service._room_wait_until = float("inf")
        await service._first_profiles()
        assert len(service._changed) == 8  # no room: nothing listed, nothing taken
        service._room_wait_until = 0.0
        left = []
        for _ in range(3):
            await service._first_profiles()
            left.append(len(service._changed))
        assert left == [5, 2, 0]
        assert service.not_profiled.counts[NO_LAYOUT] == 16
    finally:
        await engine.close()
