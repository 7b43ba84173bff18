"""The first rebalance is a warm one (issue 42.3): every context's option row
(``engine/option_rows.py``) is built as the context arrives through the put path, and again
as a restarted daemon adopts the contexts it finds on disk, so the first ``rebalance`` after
many puts or after a restart reuses rows instead of working out every context's grid then
(issue 42 saw 13.9 s at 50,000 contexts). A correctness check, not a timing one"""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvtierd.config import DaemonConfig, TierConfig
from kvtierd.engine import Engine
from kvtierd.kernels.chunk_codec import ChunkFormat
from kvtierd.policies.loader import parse_policy
from kvtierd.types import ObjectMeta

GRID = "placer: evicpress\nvariants: {methods: [knorm, int8, int4], ratios: [0.5, 0.25]}\n"
FMT = ChunkFormat((2, 2, 16, 64), "bfloat16", 2)
CHUNK_BYTES = 2 * 2 * 16 * 64 * 2


def _config(tmp: Path) -> DaemonConfig:
    tiers = (
        TierConfig("cpu", "cpu", 64 * CHUNK_BYTES, options={"staging_bytes": "8MiB"}),
        TierConfig("ssd", "ssd", 1 << 26, str(tmp / "ssd")),
    )
    return DaemonConfig(socket_path=str(tmp / "s"), data_dir=str(tmp / "data"), tiers=tiers)


def _metas(n: int) -> list[ObjectMeta]:
    """``n`` contexts: plain ones of one object, every third one of three layout chunks."""
    out = []
    for i in range(n):
        if i % 3:
            out.append(ObjectMeta(key=f"c{i}", size_bytes=4096, context_id=f"c{i}"))
            continue
        out += [ObjectMeta(key=f"c{i}/{j}", size_bytes=CHUNK_BYTES, context_id=f"c{i}",
                           layout=FMT.layout(), token_count=16) for j in range(3)]  # fmt: skip
    return out


async def _put(engine: Engine, metas: list[ObjectMeta], durable: bool) -> None:
    for at in range(0, len(metas), 16):
        allocs = engine.allocate(metas[at : at + 16])
        await engine.commit([a.allocation_id for a in allocs], durable)


def _rows_built_by_a_rebalance(engine: Engine) -> int:
    """How many option rows the next rebalance's pass would build (0: all are kept)."""
    rows = engine.placing.rows
    before = rows.rebuilt
    rows.arrays(engine.placing.placed())
    return rows.rebuilt - before


def test_rows_exist_before_the_first_rebalance_after_puts_and_after_a_restart(tmp_path: Path):
    async def run() -> None:
        engine = Engine(_config(tmp_path))
        await engine.start()
        try:
            await engine.apply_policy(parse_policy(GRID, "grid.yaml"))
            await _put(engine, _metas(60), durable=False)
            await engine.executor.idle()
            assert engine.placing.placed()  # (the placer may drop some: CPU tier of 64 chunks)
            assert _rows_built_by_a_rebalance(engine) == 0
        finally:
            await engine.close(flush_s=5.0)
        again = Engine(_config(tmp_path))
        await again.start()
        try:
            await again.executor.idle()
            assert again.placing.placed()  # found on the SSD tier (placed or flushed there)
            assert _rows_built_by_a_rebalance(again) == 0
        finally:
            await again.close()

    asyncio.run(run())
