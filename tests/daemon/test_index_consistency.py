"""The index and the tiers agree. The index never names an object it no longer holds, at any
await. Deleting a context's
objects awaits each tier's delete; a context whose keys still listed objects already taken out
of the index made every reader on the event loop that walks them fail with ``KeyError`` while
it waited (seen in bench_e2e: a routed prompt's link, ``SetContextTokens``, failed as an
internal error while the fixed placer replaced a context's chunks by its variant). In process:
real tiers, placer and executor."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path

import pytest

from kvtierd.config import DaemonConfig, TierConfig
from kvtierd.engine import Engine
from kvtierd.policies.loader import parse_policy
from kvtierd.types import Operation, OpKind, Placement
from tests.daemon.test_profiling_engine import (  # registered_evaluators: a fixture
    _put_context,
    _until,
    registered_evaluators,  # noqa: F401
)

pytestmark = pytest.mark.usefixtures("registered_evaluators")


def _config(tmp: Path) -> DaemonConfig:
    """A CPU tier too small for a chunk, so the chunks are on SSD: its deletes are file
    operations the event loop waits for. The LRU placer keeps what fits: the embedded
    EvicPress policy weighs an SSD load against recomputing, and on a loaded machine the SSD
    calibrates slow enough that it drops the context as it arrives."""
    tiers = (
        TierConfig("cpu", "cpu", 4096, options={"staging_bytes": "32MiB"}),
        TierConfig("ssd", "ssd", 64 << 20, str(tmp / "ssd")),
    )
    lru = tmp / "lru.yaml"
    lru.write_text("name: lru\nplacer: lru\n")
    return DaemonConfig(socket_path=str(tmp / "s"), data_dir=str(tmp / "data"), tiers=tiers,
                        policy_file=str(lru))  # fmt: skip


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    e = Engine(_config(tmp_path))
    await e.start()
    yield e
    await e.close()


async def _dangling_while(engine: Engine, work: Awaitable[object]) -> list[str]:
    """Runs ``work`` while a watcher, at every turn of the event loop, lists each context key
    whose object is not in the index."""
    seen: list[str] = []
    done = asyncio.Event()

    async def watch() -> None:
        index = engine.index
        while not done.is_set():
            for ctx in list(index.contexts.values()):
                seen.extend(k for k in ctx.keys if k not in index.objects)
            await asyncio.sleep(0)

    watcher = asyncio.ensure_future(watch())
    try:
        await work
    finally:
        done.set()
        await watcher
    return seen


async def test_replacing_a_context_by_its_variant_never_leaves_dangling_keys(
    engine: Engine,
) -> None:
    await _put_context(engine, "doc")
    ctx = engine.contexts["doc"]
    assert ctx.variant == "none" and len(ctx.keys) > 1

    async def compress() -> None:
        await engine.apply_policy(parse_policy("placer: fixed\nvariant: int8\n", "f.yaml"))
        await _until(lambda: ctx.variant == "int8" and not engine.executor.pending)

    assert await _dangling_while(engine, compress()) == []
    assert not engine.executor.failed


async def test_dropping_a_context_never_leaves_dangling_keys(engine: Engine) -> None:
    await _put_context(engine, "doc")
    ctx = engine.contexts["doc"]
    assert await _dangling_while(engine, engine.mover.drop_context(ctx)) == []
    assert "doc" not in engine.contexts and not ctx.keys


async def test_a_variant_moved_up_from_ssd_leaves_no_copy_there(engine: Engine) -> None:
    """A variant the daemon wrote to the SSD tier, then moved to the CPU tier, is not kept on
    SSD: only a client's durable commit keeps a persistent copy (docs/daemon.md). Before, every
    variant written to SSD counted as durable, so each move up left a copy the placer does not
    charge, and the SSD tier filled past its capacity (e2e EvicPress run: 69.7 MB in a 58 MB
    tier, 21 of its objects such copies)."""
    await _put_context(engine, "doc")
    ctx = engine.contexts["doc"]
    original = engine.index.placement_of(ctx)
    await engine.executor.apply(
        Operation(OpKind.COMPRESS, "doc", original, Placement("int8", "ssd"))
    )
    assert engine.index.placement_of(ctx) == Placement("int8", "ssd")
    ssd, stored = engine.tiers["ssd"], {engine.index.objects[k].meta.key for k in ctx.keys}
    assert {m.key for m in ssd.metas()} >= stored
    await engine.executor.apply(
        Operation(OpKind.MOVE, "doc", Placement("int8", "ssd"), Placement("int8", "cpu"))
    )
    assert engine.index.placement_of(ctx) == Placement("int8", "cpu")
    assert not {m.key for m in ssd.metas()} & stored
    assert not engine.executor.failed
