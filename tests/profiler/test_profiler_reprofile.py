"""Drift trigger: fires on a quality drop, never while loads are queued, rate-limited."""

from __future__ import annotations

import asyncio

import pytest

from kvtierd.profiler import Decision, DriftSample, ReprofileLoop, ReprofileScheduler, TokenBucket


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def sample(online: float, profiled: float = 0.9, n: int = 8, cid: str = "c") -> DriftSample:
    return DriftSample(cid, "knorm@0.5", profiled, online, n)


def scheduler(busy: list[bool], clock: Clock, **kw: float) -> ReprofileScheduler:
    return ReprofileScheduler(0.1, lambda: busy[0], clock=clock, **kw)


def test_fires_only_when_the_drop_exceeds_the_threshold() -> None:
    s = scheduler([False], Clock())
    assert s.decide(sample(online=0.85)) is Decision.NO_DRIFT
    assert s.decide(sample(online=0.80)) is Decision.NO_DRIFT  # drop == threshold
    assert s.decide(sample(online=0.79)) is Decision.REPROFILE
    assert s.decide(sample(online=0.2, n=0)) is Decision.NO_SAMPLE
    assert s.decide(None) is Decision.NO_SAMPLE


def test_does_not_fire_while_loads_are_queued() -> None:
    busy = [True]
    s = scheduler(busy, Clock(), burst=1)
    assert s.decide(sample(online=0.1)) is Decision.BUSY
    assert s.bucket.tokens == 1.0  # a busy answer spends no token
    busy[0] = False
    assert s.decide(sample(online=0.1)) is Decision.REPROFILE


def test_rate_limit_holds() -> None:
    clock = Clock()
    s = scheduler([False], clock, rate_per_s=0.1, burst=2)
    assert [s.decide(sample(0.1)) for _ in range(3)] == [
        Decision.REPROFILE, Decision.REPROFILE, Decision.RATE_LIMITED,
    ]  # fmt: skip
    clock.t = 9.9
    assert s.decide(sample(0.1)) is Decision.RATE_LIMITED
    clock.t = 10.0
    assert s.decide(sample(0.1)) is Decision.REPROFILE
    clock.t = 1000.0  # refills only up to the burst
    assert [s.decide(sample(0.1)) for _ in range(3)].count(Decision.REPROFILE) == 2


def test_token_bucket_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="rate_per_s"):
        TokenBucket(0.0, 1, 0.0)
    with pytest.raises(ValueError, match="capacity"):
        TokenBucket(1.0, 0.5, 0.0)


def test_loop_measures_and_reprofiles_while_idle_and_stops_when_busy() -> None:
    busy = [False]
    quality = {"a": 0.5, "b": 0.88, "c": 0.3}
    measured: list[str] = []
    reprofiled: list[str] = []

    async def measure(cid: str) -> DriftSample:
        measured.append(cid)
        if cid == "b" and len(measured) < 3:
            busy[0] = True  # loads arrive while we work: the pass must stop
        return sample(online=quality[cid], cid=cid)

    async def reprofile(cid: str) -> None:
        reprofiled.append(cid)

    loop = ReprofileLoop(
        scheduler(busy, Clock()),
        candidates=lambda: ["a", "b", "c"],
        measure=measure,
        reprofile=reprofile,
        interval_s=0.01,
    )
    steps = asyncio.run(loop.run_once())
    assert [(s.context_id, s.decision) for s in steps] == [
        ("a", Decision.REPROFILE), ("b", Decision.NO_DRIFT), ("c", Decision.BUSY),
    ]  # fmt: skip
    assert measured == ["a", "b"] and reprofiled == ["a"]
    busy[0] = False
    asyncio.run(loop.run_once())
    assert reprofiled == ["a", "a", "c"]


def test_loop_propagates_failures() -> None:
    async def measure(cid: str) -> DriftSample:
        raise RuntimeError("kv fetch failed")

    async def reprofile(cid: str) -> None:
        pass

    loop = ReprofileLoop(
        scheduler([False], Clock()),
        candidates=lambda: ["a"],
        measure=measure,
        reprofile=reprofile,
        interval_s=0.001,
    )
    with pytest.raises(RuntimeError, match="kv fetch failed"):
        asyncio.run(asyncio.wait_for(loop.run_forever(), 5))
