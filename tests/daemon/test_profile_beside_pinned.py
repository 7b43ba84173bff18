"""A profile whose best placement does not fit beside pinned contexts (issue 18: the daemon's
profiling task died on it, silently, during a run with a small CPU tier; the health check then
reported "profiling task stopped" and nothing was profiled again). The context stays where it
is, the run counts as done, and the loop keeps profiling."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvtierd.config import DaemonConfig, TierConfig
from kvtierd.engine import Engine
from kvtierd.policies.loader import parse_policy
from tests.daemon.test_profiling_engine import (  # registered_evaluators: a fixture
    CHUNK_BYTES,
    CHUNKS,
    TailTopicEvaluator,
    _put_context,
    registered_evaluators,  # noqa: F401
)

pytestmark = pytest.mark.usefixtures("registered_evaluators")


async def test_a_profile_that_cannot_be_placed_leaves_the_context_and_the_loop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tiers = (
        TierConfig("cpu", "cpu", CHUNKS * CHUNK_BYTES + 4096, options={"staging_bytes": "32MiB"}),
        TierConfig("ssd", "ssd", 0, str(tmp_path / "ssd")),
    )
    config = DaemonConfig(socket_path=str(tmp_path / "s"), data_dir=str(tmp_path / "d"),
                          tiers=tiers)  # fmt: skip
    engine = Engine(config)
    await engine.start()
    try:
        policy = parse_policy(
            "placer: evicpress\nvariants: {methods: [knorm], ratios: [0.5]}\n"
            "profiling: {min_queries: 1}\n", "p.yaml",
        )  # fmt: skip
        await engine.apply_policy(
            replace(policy, estimator=TailTopicEvaluator.name, evaluator=TailTopicEvaluator.name)
        )
        await _put_context(engine, "a")  # the CPU tier's only context
        await engine.executor.idle()
        assert engine.index.placement_of(engine.contexts["a"]).tier == "cpu"
        engine.set_pinned(["a"], True)
        await _put_context(engine, "b")  # does not fit beside a: one tier down
        await engine.executor.idle()
        b = engine.contexts["b"]
        assert engine.index.placement_of(b).tier == "ssd"
        engine.set_pinned(["b"], True)  # e.g. held by a lookup that is about to load it
        # knorm@0.5 of b would fit in the CPU tier only if a moved, and neither may move
        assert await engine.profiling.profile_context(b)
        await engine.executor.idle()
        assert engine.index.placement_of(b).tier == "ssd"
        assert "profiled, and stays where it is" in caplog.text
        assert engine.profiling.healthy
    finally:
        await engine.close()
