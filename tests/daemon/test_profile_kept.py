"""A context dropped from every tier keeps its profile and frequency (``Profiler.set_aside``):
when its prompt is computed and stored again the placer knows it at once, and the daemon does
not spend another profile on it. The request that computed it again counts in its frequency
(a miss asks for the context as much as a hit does)."""

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
    # kept, and the request that computed it again counts once (not once per chunk)
    assert engine.profiling.options.frequency("doc") == pytest.approx(frequency + 1, rel=1e-3)
    ctx = engine.contexts["doc"]
    (lease,) = await engine.get([next(iter(ctx.keys))])  # a load counts on from there
    engine.release([lease.lease_id])
    assert engine.profiling.options.frequency("doc") == pytest.approx(frequency + 2, rel=1e-3)
    await _until(lambda: engine.index.placement_of(ctx).variant == "knorm@0.5")
    assert engine.profiling.runs["ok"] == 1


async def test_the_request_that_computes_a_context_counts_once(tmp_path: Path) -> None:
    """Its puts (one per chunk here) are one request: frequency 1, not the chunk count, and
    before it any load; without this a dropped context only ever had the hits it earned while
    held, and the placer never let it back in against those it kept."""
    engine = Engine(_config(tmp_path))
    await engine.start()
    try:
        await _apply_knorm_policy(engine, "")
        assert engine.profiling.options.frequency("doc") is None
        await _put_context(engine, "doc")
        await engine.executor.idle()
        assert len(engine.contexts["doc"].keys) > 1
        assert engine.profiling.options.frequency("doc") == pytest.approx(1.0, rel=1e-3)
    finally:
        await engine.close()


async def test_the_estimators_profile_moves_a_context_on_few_queries(tmp_path: Path) -> None:
    """Before issue 26 a context profiled on fewer than min_queries queries stayed unmoved, and
    one the placer kept dropping was profiled again on each return, on the same queries (11
    profiles inside bench_e2e's timed run). The estimator's profile is trusted from the first
    put: the context is placed on it, and a return reuses it."""
    engine = Engine(_config(tmp_path))
    await engine.start()
    try:
        await _apply_knorm_policy(engine, "")  # min_queries 3
        await engine.profiling.inputs.add_queries("doc", ["a head question"], from_traffic=True)
        await _put_context(engine, "doc")
        ctx = engine.contexts["doc"]
        await _until(lambda: engine.index.placement_of(ctx).variant == "knorm@0.5")
        assert engine.profiling.profiler.trusted("doc")  # type: ignore[union-attr]

        assert await engine.evict(["doc"]) == 1
        await _put_context(engine, "doc")  # back
        await _until(lambda: not engine.profiling._changed)  # settled: nothing ran
        assert engine.profiling.runs["ok"] == 1
    finally:
        await engine.close()
