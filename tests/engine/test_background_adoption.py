"""Contexts found at start are adopted in the background when there are many (issue 42.5:
adoption costs 0.1-0.5 ms a context, minutes at 1M, and the index alone serves reads), and
never twice: a context the placer learned of otherwise first is passed over."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
from pathlib import Path

import pytest

from kvtierd.config import DaemonConfig, TierConfig
from kvtierd.engine import Engine
from kvtierd.engine import placing as placing_module
from kvtierd.engine.shutdown_flush import ACCESS_TIMES_FILE
from kvtierd.storage.ssd import SsdTier
from kvtierd.types import ObjectMeta, Plan

CONTEXTS = 30


def _config(tmp: Path) -> DaemonConfig:
    tiers = (
        TierConfig("cpu", "cpu", 1 << 20, options={"staging_bytes": "8MiB"}),
        TierConfig("ssd", "ssd", 1 << 26, str(tmp / "ssd")),
    )
    return DaemonConfig(socket_path=str(tmp / "s"), data_dir=str(tmp / "data"), tiers=tiers)


async def _fill_ssd(tmp: Path) -> None:
    """``CONTEXTS`` contexts of one 4 KiB object each, written as a daemon leaves them."""
    tier = SsdTier(TierConfig("ssd", "ssd", 0, str(tmp / "ssd"), {}))
    await tier.start()
    data = memoryview(bytes(4096))
    await tier.put_many([
        (ObjectMeta(key=f"k{i}", size_bytes=4096, context_id=f"c{i}"), data)
        for i in range(CONTEXTS)
    ])  # fmt: skip
    await tier.close()


@pytest.fixture
def few_before_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placing_module, "ADOPT_BEFORE_SERVING", 5)
    monkeypatch.setattr(placing_module, "ADOPT_SLICE", 4)


def test_many_contexts_found_at_start_are_adopted_after_it(
    tmp_path: Path, few_before_serving: None, caplog: pytest.LogCaptureFixture
):
    async def run() -> None:
        await _fill_ssd(tmp_path)
        engine = Engine(_config(tmp_path))
        with caplog.at_level(logging.INFO, logger="kvtierd.engine.placing"):
            await engine.start()
            try:
                assert len(engine.index.contexts) == CONTEXTS  # the index is whole at once
                assert engine.placing.adopting is not None
                await engine.placing.adopting
                assert engine.placing.unadopted == 0
                for ctx in engine.index.contexts.values():
                    assert engine.placing.target(ctx.context_id) == engine.index.placement_of(ctx)
            finally:
                await engine.close()
        assert f"adopting {CONTEXTS} contexts found at start in the background" in caplog.text
        assert f"adopted {CONTEXTS} contexts found at start in" in caplog.text

    asyncio.run(run())


def test_a_context_the_placer_learned_of_first_is_not_adopted_again(
    tmp_path: Path, few_before_serving: None
):
    async def run() -> None:
        await _fill_ssd(tmp_path)
        engine = Engine(_config(tmp_path))
        await engine.start()
        try:
            assert engine.placing.adopting is not None
            await engine.placing.adopting
            placing = engine.placing
            adopted: list[str] = []
            where_it_is = placing.adopt_where_it_is

            def spy(ctx):  # type: ignore[no-untyped-def]
                adopted.append(ctx.context_id)
                return where_it_is(ctx)

            placing.adopt_where_it_is = spy  # type: ignore[method-assign]
            contexts = sorted(engine.index.contexts.values(), key=lambda c: c.context_id)
            plans: list[Plan] = []
            placing.adopt_found(contexts, plans.append)
            assert placing.unadopted == CONTEXTS  # nothing adopted before the loop turns
            placing.insert(contexts[0])  # a put's insert reached the placer first
            await placing.adopting
            assert sorted(adopted) == sorted(c.context_id for c in contexts[1:])
            assert placing.unadopted == 0
        finally:
            await engine.close()

    asyncio.run(run())


def test_few_contexts_are_adopted_before_the_daemon_serves(tmp_path: Path):
    async def run() -> None:
        await _fill_ssd(tmp_path)
        engine = Engine(_config(tmp_path))
        await engine.start()
        try:
            assert engine.placing.adopting is None
            for ctx in engine.index.contexts.values():
                assert engine.placing.target(ctx.context_id) == engine.index.placement_of(ctx)
        finally:
            await engine.close()

    asyncio.run(run())


@pytest.mark.parametrize("many", [False, True], ids=["before-serving", "in-the-background"])
def test_an_lru_restart_keeps_the_saved_recency_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, many: bool
):
    """A graceful stop saves each context's last access; the restart adopts the least recent
    first, so that the LRU placer's order in a tier is the saved one, not the keys' (each
    context it adopts it ranks most recent). Contexts the stop saved no time for come last."""
    if many:
        monkeypatch.setattr(placing_module, "ADOPT_BEFORE_SERVING", 5)
        monkeypatch.setattr(placing_module, "ADOPT_SLICE", 4)

    async def run() -> None:
        await _fill_ssd(tmp_path)
        policy = tmp_path / "lru.yaml"
        policy.write_text("name: lru\nplacer: lru\n")
        config = dataclasses.replace(_config(tmp_path), policy_file=str(policy))
        recency = [f"c{i}" for i in random.Random(0).sample(range(CONTEXTS), CONTEXTS)]
        saved = recency[:-3]  # the last three: no time saved
        now = time.time()
        times = {cid: now - 1000 + i for i, cid in enumerate(saved)}
        Path(config.data_dir).mkdir(parents=True, exist_ok=True)
        (Path(config.data_dir) / ACCESS_TIMES_FILE).write_text(json.dumps(times))
        engine = Engine(config)
        await engine.start()
        try:
            if engine.placing.adopting is not None:
                await engine.placing.adopting
            assert (engine.placing.adopting is not None) == many
            ssd = engine.placing.placer._lru[1]  # type: ignore[attr-defined]
            order = list(ssd)  # least recent first
            assert order[: len(saved)] == saved
            assert sorted(order[len(saved) :]) == sorted(recency[-3:])
        finally:
            await engine.close()

    asyncio.run(run())
