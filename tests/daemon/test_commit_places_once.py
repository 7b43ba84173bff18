"""A commit tells the placer of each context it grew once, whatever the number of its objects.

The LMCache plugin stores a prompt's chunks in one Allocate/Commit. When the placer was told of
every object in turn, it placed each partial context, displaced others for it, and brought them
back as the context grew: in the end-to-end EvicPress run, 171 moves and 120 placements for 86
requests, most of them such round trips between the CPU and SSD tiers.
"""

from __future__ import annotations

import pytest

from kvtierd.engine import Engine
from kvtierd.engine.state import ContextRecord
from kvtierd.types import Plan
from tests.daemon.test_tier_capacity import _request, engine  # noqa: F401 (a fixture)


async def test_each_context_is_placed_once_per_commit(
    engine: Engine,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    told: list[tuple[str, int]] = []
    insert = engine.placing.insert

    def counted(ctx: ContextRecord) -> Plan:
        told.append((ctx.context_id, len(ctx.keys)))
        return insert(ctx)

    monkeypatch.setattr(engine.placing, "insert", counted)
    await _request(engine, "doc", 3)  # three chunks, one commit
    await _request(engine, "other", 2)
    await _request(engine, "doc", 5)  # a longer prompt: two more chunks join "doc"
    await engine.executor.idle()
    # each time with every chunk of the commit already in the context
    assert told == [("doc", 3), ("other", 2), ("doc", 5)]
    assert len(engine.contexts["doc"].keys) == 5
    assert not engine.executor.failed
