"""A context dropped from every tier keeps its profile and frequency (``Profiler.set_aside``):
when its prompt is computed and stored again the placer knows it at once, and the daemon does
not spend another profile on it. The request that computed it again counts in its frequency
(a miss asks for the context as much as a hit does)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kvtierd.engine import Engine
from kvtierd.engine.state import ContextRecord
from kvtierd.errors import InvalidArgumentError
from kvtierd.policies.loader import parse_policy
from kvtierd.types import Operation, OpKind, Placement, Plan
from tests.daemon.test_profiling_engine import (  # registered_evaluators: a fixture
    CHUNKS,
    T,
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


async def test_a_compression_that_found_no_token_ids_runs_once_they_arrive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seen in CI: a dropped context came back while the ids it had before were still being
    dropped (on the profiler's thread). The placer chose knorm@0.5 on those ids, the
    compression then found none, and the context stayed whole while the placer counted it
    compressed: nothing placed it again when its ids arrived. Here the placer is shown the
    variant as servable with no ids at all, which is what that race leaves."""
    engine = Engine(_config(tmp_path))
    await engine.start()
    try:
        await _apply_knorm_policy(engine, "  min_queries: 1\n")
        await _put_context(engine, "doc")
        await engine.profiling.inputs.add_queries("doc", ["a head question"], from_traffic=False)
        await _until(lambda: engine.profiling.runs["ok"] >= 1 and not engine.executor.pending)
        ctx = engine.contexts["doc"]
        await _until(lambda: engine.index.placement_of(ctx).variant == "knorm@0.5")
        assert await engine.evict(["doc"]) == 1
        await _until(lambda: engine.profiling.options.profiled("doc") != {})

        servable = engine.profiling.servable
        shown = servable.options

        def stale(*args: Any) -> list[str]:  # until the compression found the ids gone
            return shown(*args) if engine.executor.failed["compress"] else list(args[2])

        monkeypatch.setattr(servable, "options", stale)
        await _put_context(engine, "doc", tokens=False)
        # no ids to write the servable form: the compression fails (its plan may be submitted
        # after the put returns, by the placer's pass; seen on a busy machine)
        await _until(lambda: engine.executor.failed["compress"] >= 1)
        await engine.executor.idle()
        ctx = engine.contexts["doc"]
        assert engine.index.placement_of(ctx).variant == "none"
        # the placer learnt the truth: whole, where the failed plan left it
        assert engine.placing.target("doc").variant == "none"

        await engine.profiling.inputs.set_tokens("doc", list(range(1, CHUNKS * T + 1)))
        await _until(lambda: engine.index.placement_of(ctx).variant == "knorm@0.5")
        await engine.executor.idle()
        assert engine.placing.target("doc") == engine.index.placement_of(ctx)
    finally:
        await engine.close()


async def test_a_compression_that_keeps_failing_is_not_planned_in_a_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The placer adopts where a failed operation left the context, which can plan the same
    compression again (a fixed-compression placer adopts by placing afresh; EvicPress may
    resolve an overflow by it): a failure that persists must stop there, not keep the
    executor busy for ever."""
    engine = Engine(_config(tmp_path))
    await engine.start()
    try:
        await engine.apply_policy(parse_policy("placer: fixed\nvariant: int8\n", "f.yaml"))

        async def refuse(*_: Any) -> None:
            raise InvalidArgumentError("refused by the test")

        monkeypatch.setattr(engine.variants, "compress_context", refuse)
        adopt = engine.placing.adopt_where_it_is

        def resolve_by_compressing(ctx: ContextRecord) -> Plan:  # what an overflow may do
            where = engine.index.placement_of(ctx)
            again = Operation(OpKind.COMPRESS, ctx.context_id, where, Placement("int8", "cpu"))
            return adopt(ctx) + Plan((again,))

        monkeypatch.setattr(engine.placing, "adopt_where_it_is", resolve_by_compressing)
        await _put_context(engine, "doc")
        await asyncio.wait_for(engine.executor.idle(), 20)
        # one per put (a fixed placer places each chunk), and one retry on adopting at most
        assert 1 <= sum(engine.executor.failed.values()) <= 2 * CHUNKS
        assert engine.index.placement_of(engine.contexts["doc"]).variant == "none"
    finally:
        await engine.close()


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
