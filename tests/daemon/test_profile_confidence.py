"""The confidence rule in the daemon (issue 18.11): a context profiled on fewer than
``profiling.min_queries`` queries stays where it is (the original), says so in ProfileStatus
and DescribeContext, and is profiled again on its own once real traffic brings enough
queries — then the placer acts on the profile."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtierd.engine import Engine
from kvtierd.rpc import kvtier_pb2 as pb
from kvtierd.server.admin import AdminServicer
from kvtierd.server.health import HealthMonitor
from tests.daemon.test_profiling_engine import (  # registered_evaluators: a fixture
    _apply_knorm_policy,
    _config,
    _put_context,
    _until,
    registered_evaluators,  # noqa: F401
)

pytestmark = pytest.mark.usefixtures("registered_evaluators")


async def test_a_profile_moves_the_context_only_from_min_queries_on(tmp_path: Path) -> None:
    engine = Engine(_config(tmp_path))
    await engine.start()
    try:
        admin = AdminServicer(engine, HealthMonitor(engine))
        # knorm@0.5 scores 0.95 on 'head' questions and is worth compressing for (see
        # test_profiling_engine.py); the default min_queries is 3
        await _apply_knorm_policy(engine, "  interval_s: 0.2\n")
        # the question first, so that the profile after the put (once it settles) has it
        await engine.profiling.inputs.add_queries("doc", ["a head question"], from_traffic=True)
        await _put_context(engine, "doc")
        ctx = engine.contexts["doc"]
        await _until(lambda: engine.profiling.runs["ok"] >= 1 and not engine.executor.pending)
        await engine.executor.idle()
        status = await admin.ProfileStatus(pb.ProfileStatusRequest(context_id="doc"), None)
        assert (status.profiled, status.num_queries, status.min_queries) == (True, 1, 3)
        assert not status.trusted
        assert {v.variant: v.quality for v in status.variants}["knorm@0.5"] > 0.9  # shown
        assert engine.index.placement_of(ctx).variant == "none"  # but it moved nothing
        described = await admin.DescribeContext(pb.DescribeContextRequest(context_id="doc"), None)
        assert "profile is from 1 queries, below profiling.min_queries 3" in described.reason
        assert {o.variant: o.quality for o in described.options}["knorm@0.5"] == 0.0

        # Two more real queries: the daemon profiles it again by itself, and now acts.
        await engine.profiling.inputs.add_queries("doc", ["head 2", "head 3"], from_traffic=True)
        await _until(lambda: engine.profiling.runs["ok"] >= 2)
        await _until(lambda: engine.index.placement_of(ctx).variant == "knorm@0.5")
        status = await admin.ProfileStatus(pb.ProfileStatusRequest(context_id="doc"), None)
        assert (status.num_queries, status.trusted) == (3, True)
        described = await admin.DescribeContext(pb.DescribeContextRequest(context_id="doc"), None)
        assert "min_queries" not in described.reason
    finally:
        await engine.close()
