"""A context dropped from every tier keeps its profile and frequency (``Profiler.set_aside``):
when its prompt is computed and stored again the placer knows it at once, and the daemon does
not spend another profile on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtierd.engine import Engine
from tests.daemon.test_profiling_engine import (  # registered_evaluators: a fixture
    _apply_knorm_policy,
    _config,
    _put_context,
    _until,
    registered_evaluators,  # noqa: F401
)

pytestmark = pytest.mark.usefixtures("registered_evaluators")


async def test_a_dropped_context_comes_back_profiled(tmp_path: Path) -> None:
    engine = Engine(_config(tmp_path))
    await engine.start()
    try:
        await _dropped_and_back(engine)
    finally:
        await engine.close()


async def _dropped_and_back(engine: Engine) -> None:
    await _apply_knorm_policy(engine, "  min_queries: 1\n")
    await _put_context(engine, "doc")
    await engine.profiling.inputs.add_queries("doc", ["a head question"], from_traffic=False)
    await _until(lambda: engine.profiling.runs["ok"] >= 1 and not engine.executor.pending)
    before = engine.profiling.options.profiled("doc")
    assert before["knorm@0.5"].quality > 0.9
    frequency = engine.profiling.options.frequency("doc")
    assert frequency is not None

    assert await engine.evict(["doc"]) == 1  # its bytes are gone from every tier
    assert "doc" not in engine.contexts
    await _put_context(engine, "doc")  # the same prompt computed and stored again
    await engine.executor.idle()
    assert engine.profiling.options.profiled("doc") == before  # known at once, not re-measured
    assert engine.profiling.options.frequency("doc") == pytest.approx(frequency, rel=1e-3)  # kept
    ctx = engine.contexts["doc"]
    (lease,) = await engine.get([next(iter(ctx.keys))])  # a load counts on from there
    engine.release([lease.lease_id])
    assert engine.profiling.options.frequency("doc") == pytest.approx(frequency + 1, rel=1e-3)
    await _until(lambda: engine.index.placement_of(ctx).variant == "knorm@0.5")
    assert engine.profiling.runs["ok"] == 1
