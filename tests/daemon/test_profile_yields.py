"""Background profiling yields to serving (``profiler/yield_gate.py``): the engine counts a
request as being served for ``profile_quiet_s`` after its Lookup or Get, and the evaluator's
steps wait through that, not only the start of a context's profile."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from kvtierd.config import validate
from kvtierd.engine import Engine
from kvtierd.errors import ConfigError
from kvtierd.policy_config import parse_policy
from kvtierd.profiler.yield_gate import YieldGate
from tests.daemon.test_profiling_engine import _config, _put_context, _until


async def _attention_policy(engine: Engine) -> None:
    policy = parse_policy(
        "placer: evicpress\nvariants:\n  methods: [knorm]\n  ratios: [1.0, 0.5]\n"
        "profiling:\n  evaluator: attention\n  min_queries: 1\n",
        "test.yaml",
    )
    await engine.apply_policy(policy)


async def test_a_read_keeps_the_engine_busy_for_profile_quiet_s(tmp_path: Path) -> None:
    engine = Engine(replace(_config(tmp_path), profile_quiet_s=1.0))
    await engine.start()
    try:
        assert not engine.loads_busy()
        await engine.lookup(["not-stored"])  # a miss is a request being served too
        assert engine.loads_busy()
        await _until(lambda: not engine.loads_busy(), timeout_s=10)
    finally:
        await engine.close()


async def test_profiling_steps_wait_while_requests_are_served(tmp_path: Path) -> None:
    engine = Engine(replace(_config(tmp_path), profile_quiet_s=2.0))
    await engine.start()
    try:
        await _attention_policy(engine)
        await _put_context(engine, "doc")
        await _until(lambda: engine.profiling.runs["ok"] >= 1)  # profiled while idle
        gate = engine.profiling.yield_gate
        assert gate.waits == 0  # nothing was served: no step waited

        stop = asyncio.Event()

        async def traffic() -> None:  # a lookup every 0.1 s for 1 s
            for _ in range(10):
                await engine.lookup(["doc-chunk"])
                await asyncio.sleep(0.1)
            stop.set()

        task = asyncio.create_task(traffic())
        await asyncio.sleep(0.05)  # the first lookup is in
        assert await engine.profiling.profile_context(engine.contexts["doc"])
        assert stop.is_set()  # the profile could not finish before the traffic ended
        assert gate.waits >= 1 and gate.waited_s > 0
        await task
    finally:
        await engine.close()


def test_a_gate_waits_at_most_max_wait_s() -> None:
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    gate = YieldGate(lambda: True, poll_s=0.25, max_wait_s=2.0, clock=lambda: now[0], sleep=sleep)
    assert gate.wait() == 2.0  # traffic without a gap: one step through every max_wait_s
    idle = YieldGate(lambda: False, clock=lambda: now[0], sleep=sleep)
    assert idle.wait() == 0.0 and idle.waits == 0
    assert (gate.waits, gate.waited_s) == (1, 2.0)


@pytest.mark.parametrize("value", [-1.0, 1e9])
def test_profile_quiet_s_is_validated(tmp_path: Path, value: float) -> None:
    with pytest.raises(ConfigError, match="profile_quiet_s must be between 0 and 3600"):
        validate(replace(_config(tmp_path), profile_quiet_s=value))
