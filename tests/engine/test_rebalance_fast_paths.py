"""The daemon's rebalance path at scale (issue 28) gives what its plain per-context code
gave: in a real engine (``benchmarks/micro/placer_daemon.py``'s, a few hundred contexts, the
60-variant grid), the reconcile's operations equal those built with
``ContextIndex.placement_of`` for every context, also after some contexts were re-profiled
and frequencies moved."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from benchmarks.micro import placer_daemon as pd
from kvtierd.engine import Engine
from kvtierd.types import Operation, OpKind, Plan


def _plain_reconcile(engine: Engine, reason: str) -> Plan:
    """``Placing.reconcile`` as written before issue 28's fast path."""
    placing, index = engine.placing, engine.index
    contexts = placing.placed()
    targets = placing.placer.placements([c.context_id for c in contexts])
    ops = []
    for ctx, target in zip(contexts, targets, strict=True):
        tier = index.objects[next(iter(ctx.keys))].tier if ctx.keys else None
        if target.tier == tier and (tier is None or target.variant == ctx.variant):
            continue
        source = index.placement_of(ctx)
        if target.dropped:
            kind = OpKind.DROP
        elif target.variant != source.variant:
            kind = OpKind.COMPRESS
        else:
            kind = OpKind.MOVE
        ops.append(Operation(kind, ctx.context_id, source, target, reason))
    return Plan(tuple(ops))


def test_rebalance_plan_equals_the_plain_reconcile(tmp_path: Path) -> None:
    async def run() -> None:
        chunks = np.random.default_rng(0).integers(1, 17, 400)
        grid = pd.GRIDS["60-variant grid"]
        engine = await pd._engine(tmp_path, chunks.size, int(chunks.sum()) * pd.CHUNK_BYTES, grid)
        try:
            pd._fill(engine, chunks, 0)
            await engine.executor.idle()
            for round_ in range(2):
                plan = engine.placing.rebalance()
                assert plan.operations  # the fill scattered contexts: some must move
                assert plan == _plain_reconcile(engine, "rebalance")
                kinds = {op.kind for op in plan.operations}
                assert OpKind.COMPRESS in kinds and OpKind.MOVE in kinds
                pd._reprofile(engine, 0.05, round_ + 1)
        finally:
            await engine.close()

    asyncio.run(run())
