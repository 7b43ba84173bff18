"""Issue 40.6: a hung Redis (every node stopped with SIGSTOP: connections open, no answer)
must not stall lookups. A lookup asks the remote tier about a missed key for at most the
tier's ``lookup_budget_s`` (default 50 ms), skips the tier once it is marked down (a circuit
breaker: the tier's background probe closes it again) and never waits on it longer than that
budget. It took 10 s for one miss, and 20 s for another tenant's remote-held keys."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks._support.daemon_proc import DaemonProcess, write_config
from benchmarks._support.redis_cluster import RedisClusterProcs
from kvtierd.client import KVClient
from tests.fault.remote_setup import put_on_remote, remote_tier, wait_health

pytestmark = [pytest.mark.redis]
KEYS = [f"obj-{i}" for i in range(6)]
# generous against a loaded machine, and far below what the remote tier's own timeouts allow
LOOKUP_LIMIT_S = 2.0


def _daemon(tmp_path: Path, cluster: RedisClusterProcs, started: list[DaemonProcess]):
    tier = remote_tier(cluster, "hung")
    # the tier's own timeouts as long as a real deployment's: a lookup must not wait on them
    options = {**tier["options"], "socket_timeout_s": 10.0, "op_timeout_s": 10.0}  # type: ignore[dict-item]
    tier["options"] = {**options, "lookup_budget_s": 0.05}  # the default
    config = write_config(tmp_path / "d", cpu="8MiB", ssd="16MiB", extra_tiers=[tier])
    d = DaemonProcess(config, str(tmp_path / "d" / "kvtierd.sock"), tmp_path / "d" / "log")
    started.append(d)
    return d.start()


@pytest.fixture
def daemons() -> Iterator[list[DaemonProcess]]:
    started: list[DaemonProcess] = []
    yield started
    for d in started:
        d.kill()


def _signal_all(cluster: RedisClusterProcs, sig: signal.Signals) -> None:
    for node in cluster.nodes:
        assert node.proc is not None
        os.kill(node.proc.pid, sig)


def _timed_lookup(c: KVClient, keys: list[str]) -> tuple[tuple[bool, ...], float]:
    started = time.monotonic()
    found = c.lookup(keys).found
    return found, time.monotonic() - started


def test_a_hung_redis_does_not_stall_lookups(tmp_path, cluster, daemons):
    d = _daemon(tmp_path, cluster, daemons)
    with KVClient(d.socket_path, timeout_s=60) as c:
        put_on_remote(c, KEYS)
        c.put("local", b"x" * 4096, context_id="local")
        _signal_all(cluster, signal.SIGSTOP)
        try:
            # before the tier is known to be down: the miss is asked within the budget only
            found, took = _timed_lookup(c, ["local", "never-stored"])
            assert found == (True, False) and took < LOOKUP_LIMIT_S, took
            assert "remote" in wait_health(c, serving=False, timeout_s=30)
            # down: neither a miss nor the objects it holds are asked about
            for keys in (["never-stored"], KEYS, ["local", *KEYS]):
                found, took = _timed_lookup(c, keys)
                assert took < LOOKUP_LIMIT_S, (keys, took)
                assert found == tuple(k == "local" for k in keys), (keys, found)
        finally:
            _signal_all(cluster, signal.SIGCONT)
        # the breaker closes once the background probe finds the nodes again
        assert wait_health(c, serving=True, timeout_s=60) == "SERVING"
        deadline = time.monotonic() + 30
        while not all(c.lookup(KEYS).found) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.lookup(KEYS).found == (True,) * len(KEYS)
        assert bytes(c.get(KEYS[0]))
