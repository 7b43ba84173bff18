"""A context a writer stored in a compressed form only (a router store request forcing int4, or
the plugin's fixed ``variant: int4``) has no original to compress from or restore (issue 18.9:
the daemon logged ERROR ``plan operation compress ... the original is not kept, cannot restore
it`` for such a context). The placer sees only the form the context has; it moves or drops it,
and nothing is logged above INFO for it."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

from kvtierd.config import DaemonConfig, TierConfig
from kvtierd.engine import Engine
from kvtierd.kernels.chunk_codec import chunk_format, encode_chunk
from kvtierd.policies.evicpress import EvicPressPlacer
from kvtierd.policies.loader import parse_policy
from kvtierd.policies.plan_order import BREAK_CYCLE
from kvtierd.types import (
    DROPPED,
    ORIGINAL_VARIANT,
    ObjectMeta,
    Operation,
    OpKind,
    Placement,
    Plan,
)
from tests.daemon.test_profiling_engine import CHUNKS, D, H, L, T, _config, _put_context


async def _put_int4_context(engine: Engine, cid: str) -> None:
    g = torch.Generator().manual_seed(1)
    for i in range(CHUNKS):
        kv = torch.randn(2, L, T, H * D, generator=g).to(torch.bfloat16)
        fmt = chunk_format(kv, H, "int4")
        data = encode_chunk(kv, fmt)
        raw = memoryview(data.contiguous().view(torch.uint8).numpy().tobytes())
        meta = ObjectMeta(key=f"{cid}/{i}", size_bytes=len(raw), context_id=cid,
                          variant="int4", layout=fmt.layout(), token_count=T)  # fmt: skip
        await engine.put_bytes(meta, raw)


@pytest.mark.parametrize("policy", [
    "placer: evicpress\nvariants: {methods: [knorm, int8], ratios: [1.0, 0.5]}\n",
    "placer: fixed\nvariant: knorm@0.5\n",
    "placer: lru\n",
])  # fmt: skip
async def test_a_context_stored_compressed_is_placed_in_its_own_form(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, policy: str
) -> None:
    caplog.set_level(logging.INFO)
    engine = Engine(_config(tmp_path))
    await engine.start()
    try:
        await engine.apply_policy(parse_policy(policy, "p.yaml"))
        await _put_int4_context(engine, "forced")
        await engine.executor.idle()
        ctx = engine.contexts["forced"]
        assert [v.variant for v in engine.placing.profile(ctx).variants] == ["int4"]
        assert ctx.variant == "int4" != ORIGINAL_VARIANT
        assert not await engine.profiling.profile_context(ctx)  # nothing to choose between
        await engine.executor.idle()
        assert engine.contexts["forced"].variant == "int4"
        loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert not loud, [r.getMessage() for r in loud]
    finally:
        await engine.close()


def _bounded_config(tmp_path: Path) -> DaemonConfig:
    """Both tiers bounded: nothing keeps a reference copy of an original once compressed."""
    tiers = (
        TierConfig("cpu", "cpu", 1 << 20, options={"staging_bytes": "32MiB"}),
        TierConfig("ssd", "ssd", 1 << 20, str(tmp_path / "ssd")),
    )
    return DaemonConfig(socket_path=str(tmp_path / "s"), data_dir=str(tmp_path / "d"),
                        tiers=tiers)  # fmt: skip


@pytest.mark.parametrize("held", [False, True])
async def test_a_stale_plan_for_a_form_that_can_no_longer_be_made_moves_the_form_it_has(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, held: bool
) -> None:
    """bench_e2e's EvicPress run: a plan queued before a context was compressed to int8 asked
    for another form; with no unbounded tier nothing keeps the original, and each such plan
    failed with ERROR ('its original is not kept') and left the context in the CPU tier.
    ``held``: a lookup's hold defers what would remove the context's objects; such a plan
    removes nothing (the form it has is moved), yet it was deferred hold after hold for a hot
    context while the placer counted the form it asked for."""
    caplog.set_level(logging.INFO)
    engine = Engine(_bounded_config(tmp_path))
    await engine.start()
    try:
        await engine.apply_policy(parse_policy("placer: fixed\nvariant: int8\n", "p.yaml"))
        await _put_context(engine, "c")
        await engine.executor.idle()
        ctx = engine.contexts["c"]
        assert ctx.variant == "int8" and not ctx.reference
        if held:
            ctx.hold_until_s = time.monotonic() + 60.0  # a client looked it up
        stale = Operation(OpKind.MOVE, "c", Placement("int8", "cpu"), Placement("none", "ssd"))
        engine.executor.submit(Plan((stale,)))
        await engine.executor.idle()
        assert engine.executor.deferred == []
        assert ctx.variant == "int8" and engine.index.placement_of(ctx).tier == "ssd"
        assert engine.placing.placer.placement("c") == Placement("int8", "ssd")
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        await engine.close()


async def test_a_context_taken_out_to_break_a_cycle_keeps_its_bytes(tmp_path: Path) -> None:
    """plan_order breaks a swap cycle by taking a context out and placing it again at the
    plan's end. The executor dropped it, so the placement found nothing and the context's next
    request was a miss: in bench_e2e's EvicPress run 28 of 32 requests missed. It now keeps the
    bytes and carries the placement out as a move."""
    engine = Engine(_config(tmp_path))
    await engine.start()
    try:
        await engine.apply_policy(parse_policy("placer: lru\n", "p.yaml"))
        await _put_context(engine, "c")
        await engine.executor.idle()
        source = engine.placing.placer.placement("c")
        out = Operation(OpKind.DROP, "c", source, DROPPED, BREAK_CYCLE)
        back = Operation(OpKind.PLACE, "c", DROPPED, Placement(source.variant, "ssd"))
        engine.executor.submit(Plan((out, back)))
        await engine.executor.idle()
        ctx = engine.contexts["c"]
        assert engine.index.placement_of(ctx).tier == "ssd" and len(ctx.keys) == CHUNKS
    finally:
        await engine.close()


async def test_the_placer_stops_weighing_an_original_a_compression_removed(
    tmp_path: Path,
) -> None:
    """EvicPress keeps each context's options from its insert; once the executor compressed a
    context and nothing keeps its original, the placer must not weigh (and plan) the original
    again: it is told the options the context has now, and where it is."""
    engine = Engine(_bounded_config(tmp_path))
    await engine.start()
    try:
        policy = "placer: evicpress\nvariants: {methods: [int8], ratios: [1.0]}\n"
        await engine.apply_policy(parse_policy(policy, "p.yaml"))
        await _put_context(engine, "c")
        await engine.executor.idle()
        placer = engine.placing.placer
        assert isinstance(placer, EvicPressPlacer)
        assert ORIGINAL_VARIANT in placer.variants("c")
        where = engine.placing.target("c")
        assert where.variant == ORIGINAL_VARIANT and where.tier is not None
        squeeze = Operation(OpKind.COMPRESS, "c", where, Placement("int8", where.tier))
        engine.executor.submit(Plan((squeeze,)))
        await engine.executor.idle()
        ctx = engine.contexts["c"]
        assert ctx.variant == "int8" and not ctx.reference
        assert placer.variants("c") == ("int8",)
        assert placer.placement("c") == Placement("int8", where.tier)
    finally:
        await engine.close()
