"""A context dropped from every tier keeps its profile and frequency (``Profiler.set_aside``):
when its prompt is computed and stored again the placer knows it at once, and the daemon does
not spend another profile on it. The request that computed it again counts in its frequency
(a miss asks for the context as much as a hit does)."""

from __future__ import annotations

import asyncio
import time
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


async def test_an_untrusted_profile_is_not_run_again_on_the_same_queries(tmp_path: Path) -> None:
    """A context the placer keeps dropping came back with a profile below min_queries and was
    profiled again on each return, on the same queries (11 profiles inside bench_e2e's timed
    run): that profile could move nothing either. Once its traffic repeats its queries the
    next return profiles it, and that profile is trusted."""
    engine = Engine(_config(tmp_path))
    await engine.start()
    try:
        await _apply_knorm_policy(engine, "")  # min_queries 3
        await _put_context(engine, "doc")
        inputs = engine.profiling.inputs
        await inputs.add_queries("doc", ["first", "second"], from_traffic=True)
        await _until(lambda: engine.profiling.runs["ok"] >= 1 and not engine.executor.pending)
        assert not engine.profiling.profiler.trusted("doc")  # type: ignore[union-attr]

        assert await engine.evict(["doc"]) == 1
        await _put_context(engine, "doc")  # back, on the same two queries
        await _until(lambda: not engine.profiling._changed)  # settled: nothing ran
        assert engine.profiling.runs["ok"] == 1

        assert await engine.evict(["doc"]) == 1
        await inputs.add_queries("doc", ["first", "second"], from_traffic=True)  # asked again
        await _put_context(engine, "doc")
        await _until(lambda: engine.profiling.runs["ok"] >= 2 and not engine.executor.pending)
        assert engine.profiling.profiler.trusted("doc")  # type: ignore[union-attr]
    finally:
        await engine.close()


async def test_profiling_keeps_to_its_share_of_the_time(tmp_path: Path) -> None:
    """``profiling.max_share``: after a profile of its own the daemon rests, so that profiles
    through the serving stack do not fill the time vLLM serves requests in (bench_e2e on 2
    cores: they filled most of the timed run)."""
    engine = Engine(_config(tmp_path))
    await engine.start()
    try:
        await _apply_knorm_policy(engine, "  min_queries: 1\n  max_share: 0.25\n")
        service = engine.profiling
        await _put_context(engine, "first")
        await _until(lambda: service.runs["ok"] >= 1 and not engine.executor.pending)
        assert service.resume_at > 0  # it rested after the first: 3x the time it took
        before = time.monotonic()
        service.rest_after(2.0)
        assert service.resume_at == pytest.approx(before + 6.0, abs=0.5)

        service.resume_at = time.monotonic() + 3600.0
        await _put_context(engine, "second")
        await _until(lambda: "second" in service._changed)
        await asyncio.sleep(3 * service.settle_s + 0.5)  # due, and not run: resting
        assert service.runs["ok"] == 1 and "second" in service._changed
        service.resume_at = 0.0
        await _until(lambda: service.runs["ok"] >= 2)
    finally:
        await engine.close()
