"""Issue 42: a CPU tier of small objects does not wedge its arena. Each object takes whole
4 KiB blocks there while the placer counts its bytes, so a tier of 1 KiB objects at its
capacity in bytes needs four times its capacity of arena: every put refused, and no move
planned to free room, since only a put makes the placer move contexts down (bench_scale at
1M stopped at 569k objects so). A put that finds the arena full with nothing queued has the
placer hold the rounding back (``Placing.hold_back_rounding``); the client's retry then fits.
In process: real tiers, placer and executor, for both kinds of placer."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvtierd.config import DaemonConfig, TierConfig
from kvtierd.engine import Engine
from kvtierd.errors import CapacityError
from kvtierd.types import ObjectMeta

KIB = 1024
CAPACITY = 256 * KIB  # of the CPU tier, in object bytes: 256 objects of 1 KiB
STAGING = 256 * KIB  # the arena is 512 KiB: 128 blocks of 4 KiB
PUTS = 600


def _config(tmp: Path, placer: str) -> DaemonConfig:
    tiers = (
        TierConfig("cpu", "cpu", CAPACITY, options={"staging_bytes": f"{STAGING}"}),
        TierConfig("ssd", "ssd", 64 << 20, str(tmp / "ssd")),
    )
    policy = tmp / "policy.yaml"
    policy.write_text(f"name: {placer}\nplacer: {placer}\n")
    return DaemonConfig(socket_path=str(tmp / "s"), data_dir=str(tmp / "data"), tiers=tiers,
                        policy_file=str(policy))  # fmt: skip


def _data(cid: str) -> bytes:
    return (cid.encode() * KIB)[:KIB]


@pytest.mark.parametrize("placer", ["lru", "evicpress"])
async def test_puts_of_small_objects_go_on_once_the_arena_is_full_of_rounding(
    tmp_path: Path, placer: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = Engine(_config(tmp_path, placer))
    await engine.start()
    try:
        refused = 0
        with caplog.at_level(logging.INFO, logger="kvtierd.engine.placing"):
            for i in range(PUTS):
                meta = ObjectMeta(key=f"c{i}", size_bytes=KIB, context_id=f"c{i}")
                for _attempt in range(4):  # a client retries RESOURCE_EXHAUSTED
                    try:
                        await engine.put_bytes(meta, memoryview(_data(f"c{i}")))
                        break
                    except CapacityError:
                        refused += 1
                        await engine.executor.idle()
                else:
                    pytest.fail(f"put {i} refused 4 times ({refused} refusals so far)")
                await engine.executor.idle()
        cpu = engine.mover.cpu
        assert refused > 0  # the arena did fill: the case is met
        assert 0 < engine.placing.placer.held_back[0] <= CAPACITY
        assert cpu.used_bytes() + cpu.rounding_bytes() <= CAPACITY  # blocks within capacity
        assert cpu.object_count() > 0
        assert "free for the arena's block rounding" in caplog.text
        for i in range(PUTS):  # every put stored, wherever it is
            obj = engine.objects[f"c{i}"]
            assert await engine.mover.copy_out(obj) == _data(f"c{i}"), obj.tier
    finally:
        await engine.close()
