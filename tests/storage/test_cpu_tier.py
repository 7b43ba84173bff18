"""CPU tier specifics beyond the tier matrix: arena blocks are never leaked."""

from __future__ import annotations

import asyncio
import os

from kvtierd import errors
from kvtierd.config import TierConfig
from kvtierd.storage import CpuTier
from kvtierd.types import ObjectMeta

MiB = 1 << 20


async def test_racing_puts_of_one_key_free_the_loser_s_block() -> None:
    tier = CpuTier(TierConfig("cpu", "cpu", 8 * MiB, options={"staging_bytes": 8 * MiB}))
    await tier.start()
    try:
        free_before = tier.arena.allocator.free_bytes
        blobs = [os.urandom(MiB), os.urandom(MiB)]
        results = await asyncio.gather(
            *(tier.put(ObjectMeta(key="k", size_bytes=MiB), memoryview(b)) for b in blobs),
            return_exceptions=True,
        )
        assert [type(r) for r in results].count(errors.AlreadyExistsError) == 1
        assert tier.arena.allocator.free_bytes == free_before - MiB
        await tier.delete("k")
        assert tier.arena.allocator.free_bytes == free_before
    finally:
        await tier.close()
