"""A Redis node SIGKILLed under a daemon whose contexts sit on the remote tier.

Objects on the dead node are misses (``NOT_FOUND``), never wrong bytes and never an internal
error; objects on the living nodes still read right; moves that need the dead node fail
cleanly and leave the object where it was; the daemon reports the tier unhealthy and is
``SERVING`` again once the node is back. The test nodes run without persistence, so what the
dead node held is gone for good after its restart: still a miss, never wrong bytes.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import grpc
import pytest

from benchmarks._support.workload import payload
from kvtierd import errors
from kvtierd.client import KVClient
from kvtierd.rpc import kvtier_pb2 as pb
from tests.fault.remote_setup import (
    namespace_of,
    port_of,
    put_on_remote,
    settle,
    size_of,
    wait_health,
)

pytestmark = [pytest.mark.redis, pytest.mark.slow]
KEYS = [f"obj-{i}" for i in range(15)]


def read_all(c: KVClient, keys: list[str]) -> dict[str, str]:
    """``key -> "ok" | "miss"``; anything else (wrong bytes, another error) fails the test."""
    out = {}
    for key in keys:
        try:
            data = bytes(c.get(key))
        except errors.NotFoundError:
            out[key] = "miss"
            continue
        assert data == payload(key, size_of(key)), f"wrong bytes served for {key}"
        out[key] = "ok"
    return out


def test_node_killed_reads_miss_writes_fail_cleanly_then_recover(remote_daemon, cluster):
    d = remote_daemon("d")
    ns = namespace_of(d)
    with KVClient(d.socket_path, timeout_s=30) as c:
        put_on_remote(c, KEYS)
        home = {k: port_of(cluster, ns, k) for k in KEYS}
        victim_port = Counter(home.values()).most_common(1)[0][0]
        on_victim = [k for k in KEYS if home[k] == victim_port]
        elsewhere = [k for k in KEYS if home[k] != victim_port]
        assert on_victim and elsewhere  # 15 keys over 3 nodes: the fullest holds >= 5

        cluster.kill(cluster.index_of_port(victim_port))
        got = read_all(c, KEYS)
        assert {k for k, v in got.items() if v == "miss"} == set(on_victim), got
        with KVClient(d.socket_path, timeout_s=30, stream=True) as s:  # the TCP client's path
            with pytest.raises(errors.NotFoundError):
                s.get(on_victim[0])
            assert bytes(s.get(elsewhere[0])) == payload(elsewhere[0], size_of(elsewhere[0]))
        health = wait_health(c, serving=False, timeout_s=10)
        assert "remote" in health, f"a dead node should make the tier unhealthy: {health!r}"

        # Writes that need the remote tier: drain the SSD while the node is down.
        fresh = [f"late-{i}" for i in range(9)]
        for key in fresh:
            c.put(key, payload(key, size_of(key)), context_id=key)
        settle(c)
        c.drain("cpu")
        with contextlib.suppress(errors.UnavailableError):
            c.drain("ssd")  # a clean refusal; what did not move stays on the SSD
        settle(c)
        where = {ctx.context_id: ctx.tier for ctx in c.contexts()}
        for key in fresh:
            if port_of(cluster, ns, key) == victim_port:
                assert where.get(key) == "ssd", f"{key} should have stayed on ssd: {where}"
        assert set(read_all(c, fresh).values()) == {"ok"}

        cluster.restart(cluster.index_of_port(victim_port))
        cluster.wait_ok()
        assert wait_health(c, serving=True) == "SERVING"
        # The restarted node lost its data (no persistence): misses, never wrong bytes.
        got = read_all(c, KEYS)
        assert all(got[k] == "ok" for k in elsewhere), got
        assert all(got[k] == "miss" for k in on_victim), got
        # The recovered tier takes writes again, on the restarted node too (the reads above
        # promoted the fresh contexts to cpu).
        c.drain("cpu")
        c.drain("ssd")
        settle(c)
        where = {ctx.context_id: ctx.tier for ctx in c.contexts()}
        assert all(where.get(k) == "remote" for k in fresh), where
        assert set(read_all(c, fresh).values()) == {"ok"}


def test_lookup_misses_objects_on_a_dead_node(remote_daemon, cluster):
    d = remote_daemon("d")
    ns = namespace_of(d)
    with KVClient(d.socket_path, timeout_s=30) as c:
        put_on_remote(c, KEYS)
        victim_port = port_of(cluster, ns, KEYS[0])
        on_victim = [k for k in KEYS if port_of(cluster, ns, k) == victim_port]
        cluster.kill(cluster.index_of_port(victim_port))
        wait_health(c, serving=False, timeout_s=10)
        reply = c.call(c.kv.Lookup, pb.LookupRequest(keys=on_victim))
        assert not any(reply.found), f"{sum(reply.found)} of {len(on_victim)} reported found"


def test_unreachable_reads_never_answer_internal(remote_daemon, cluster):
    """Raw gRPC view of the same fault: every Get is OK or NOT_FOUND, for many rounds."""
    d = remote_daemon("d")
    ns = namespace_of(d)
    with KVClient(d.socket_path, timeout_s=30) as c:
        put_on_remote(c, KEYS)
        cluster.kill(cluster.index_of_port(port_of(cluster, ns, KEYS[0])))
        codes: Counter[str] = Counter()
        for _ in range(3):
            for key in KEYS:
                try:
                    reply = c.kv.Get(pb.GetRequest(keys=[key]), timeout=30)
                    c.kv.Release(pb.ReleaseRequest(lease_ids=[reply.leases[0].lease_id]))
                    codes["OK"] += 1
                except grpc.RpcError as e:
                    codes[e.code().name] += 1
        assert set(codes) <= {"OK", "NOT_FOUND"}, codes
        assert codes["NOT_FOUND"] and codes["OK"], codes
