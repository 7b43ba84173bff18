"""Fixtures for the fault tests: a throw-away Redis Cluster and daemons on it, all stopped at
teardown (a daemon left running would keep probing a cluster that is gone)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks._support.arenas import now_s, remove_dead_arenas
from benchmarks._support.daemon_proc import DaemonProcess
from benchmarks._support.redis_cluster import RedisClusterProcs
from tests.fault.remote_setup import start_remote_daemon


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisClusterProcs]:
    procs = RedisClusterProcs(tmp_path / "redis")
    procs.start()
    try:
        yield procs
    finally:
        procs.stop()


@pytest.fixture
def remote_daemon(
    tmp_path: Path, cluster: RedisClusterProcs
) -> Iterator[Callable[..., DaemonProcess]]:
    """``remote_daemon(name, namespace="", **settings)`` -> a daemon with a remote tier."""
    started: list[DaemonProcess] = []

    def start(name: str, namespace: str = "", **settings: Any) -> DaemonProcess:
        d = start_remote_daemon(tmp_path / name, cluster, namespace, started=started, **settings)
        return d

    yield start
    for d in started:
        d.kill()


@pytest.fixture(autouse=True)
def _no_leaked_arenas() -> Iterator[None]:
    """These tests SIGKILL daemons; remove the arenas the killed ones left in /dev/shm."""
    since = now_s()
    yield
    remove_dead_arenas(since)
