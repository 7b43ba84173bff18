"""Fixtures for the storage tests.

Remote tier: ``redis_cluster`` (one 3-master cluster per test module, shared) and
``fresh_redis_cluster`` (one per test, for tests that kill nodes) start real ``redis-server``
processes on loopback (benchmarks/_support/redis_cluster.py); ``remote_tier`` builds started
``RemoteTier`` s on a cluster, each in a unique namespace unless told otherwise, closed at
teardown.
"""

from __future__ import annotations

import asyncio
import io
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.cluster

try:  # the helper sits beside this file; its import name depends on pytest's import mode
    from benchmarks._support.redis_cluster import RedisClusterProcs
except ModuleNotFoundError:
    from redis_cluster import RedisClusterProcs  # type: ignore[no-redef]

from kvtierd.config import TierConfig
from kvtierd.storage.remote import RemoteTier

RemoteTierFactory = Callable[..., Awaitable[RemoteTier]]
CLOSE_TIMEOUT_S = 20.0
TIER_MARKS = {"gpu": [pytest.mark.gpu], "remote": [pytest.mark.redis]}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test taking ``kind`` runs once per registered tier kind (generated from the registry:
    a new tier is tested without new test code, and fails where it has no builder)."""
    if "kind" in metafunc.fixturenames:
        from kvtierd.storage import TIERS

        kinds = [pytest.param(k, marks=TIER_MARKS.get(k, [])) for k in TIERS.names()]
        metafunc.parametrize("kind", kinds)


def _cluster(base: Path) -> Iterator[RedisClusterProcs]:
    procs = RedisClusterProcs(base)
    procs.start()
    try:
        yield procs
    finally:
        procs.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    yield from _cluster(tmp_path_factory.mktemp("redis-cluster"))


@pytest.fixture
def fresh_redis_cluster(tmp_path: Path) -> Iterator[RedisClusterProcs]:
    yield from _cluster(tmp_path / "redis-cluster")


@pytest.fixture
def raw_redis(redis_cluster: RedisClusterProcs) -> Iterator[redis.cluster.RedisCluster]:
    """A plain redis-py cluster client, for tampering with what the tier stored."""
    nodes = [redis.cluster.ClusterNode("127.0.0.1", n.port) for n in redis_cluster.nodes]
    client = redis.cluster.RedisCluster(startup_nodes=nodes, socket_timeout=5)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
async def remote_tier(
    request: pytest.FixtureRequest,
) -> AsyncIterator[RemoteTierFactory]:
    """``await remote_tier(cluster=None, capacity_bytes=0, **options)`` -> a started tier.

    ``cluster`` defaults to the module's shared ``redis_cluster``; ``namespace`` defaults to a
    fresh one per call, so tests sharing a cluster never see each other's objects.
    """
    tiers: list[RemoteTier] = []

    async def make(
        cluster: RedisClusterProcs | None = None, capacity_bytes: int = 0, **options: Any
    ) -> RemoteTier:
        procs = cluster or request.getfixturevalue("redis_cluster")
        options.setdefault("nodes", procs.addresses)
        options.setdefault("namespace", f"t-{uuid.uuid4().hex[:12]}")
        options.setdefault("op_timeout_s", 5.0)
        tier = RemoteTier(TierConfig(f"remote{len(tiers)}", "remote", capacity_bytes, "", options))
        await tier.start()
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        try:
            await asyncio.wait_for(tier.close(), CLOSE_TIMEOUT_S)
        except TimeoutError:
            stacks = io.StringIO()
            for task in asyncio.all_tasks():
                task.print_stack(file=stacks)
            pytest.fail(
                f"{tier.name}.close() took over {CLOSE_TIMEOUT_S}s; tasks:\n{stacks.getvalue()}"
            )
