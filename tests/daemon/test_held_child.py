"""Issue 40.3: a child held for its unread durable objects is outside the placer's view, and
outside its tree too. ``Rebalance`` and ``ApplyPolicy`` linked every index child again, held
ones included; when the parent was dropped next, EvicPress's ``_orphans`` raised ``KeyError``
on the held child: another tenant's put answered INTERNAL naming the first tenant's context,
was stored anyway, and the CPU tier ended over its capacity."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtierd.config import DaemonConfig, TierConfig
from kvtierd.engine import Engine
from kvtierd.policies.loader import parse_policy
from kvtierd.types import ObjectMeta

MiB = 1 << 20


def _config(tmp: Path) -> DaemonConfig:
    tiers = (
        TierConfig("cpu", "cpu", 4 * MiB, options={"staging_bytes": "32MiB"}),
        TierConfig("ssd", "ssd", 8 * MiB, str(tmp / "ssd")),
    )
    return DaemonConfig(socket_path=str(tmp / "s"), data_dir=str(tmp / "d"), tiers=tiers)


async def _put(engine: Engine, cid: str, *, parent: str = "", durable: bool = False) -> None:
    data = memoryview(bytes([len(cid)]) * MiB)
    meta = ObjectMeta(key=f"{cid}/0", size_bytes=MiB, context_id=cid,
                      parent_context_id=parent)  # fmt: skip
    await engine.put_bytes(meta, data, durable=durable)


@pytest.mark.parametrize("relink", ["rebalance", "apply_policy"])
async def test_a_held_child_stays_out_of_the_placers_tree(tmp_path: Path, relink: str) -> None:
    engine = Engine(_config(tmp_path))
    await engine.start()
    try:
        await engine.apply_policy(parse_policy("placer: evicpress\n", "p.yaml"))
        await _put(engine, "parent")
        await _put(engine, "child", parent="parent", durable=True)
        await engine.executor.idle()
        child = engine.contexts["child"]
        await engine.durable.hold(child, "drop")  # what the executor does for a planned drop
        assert child.durable_held
        if relink == "rebalance":
            await engine.rebalance()
        else:
            await engine.apply_policy(parse_policy("placer: evicpress\n", "p.yaml"))
        await engine.executor.idle()
        assert "child" not in engine.placing.placer.parents
        assert "child" not in engine.placing.placer.children.get("parent", ())
        # pressure until the parent is dropped: no put fails, no tier ends over capacity
        for i in range(24):
            await _put(engine, f"other-{i}")
            await engine.executor.idle()
            if engine.placing.target("parent").dropped:
                break
        assert engine.placing.target("parent").dropped
        assert engine.contexts["child"].durable_held  # still kept, unread
        assert engine.problems() == []
        # (the persistent tier also keeps the held child's copy, outside the placer's view)
        assert engine.cpu.used_bytes() <= engine.cpu.capacity_bytes
    finally:
        await engine.close()
