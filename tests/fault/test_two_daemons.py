"""Two daemons sharing one Redis Cluster namespace as their remote tier (issue 8, item 2).

A context daemon A stores and places on the remote tier is found and loaded by daemon B, with
the bytes A stored; what each daemon keeps on its own cpu and ssd tiers stays its own.
"""

from __future__ import annotations

import uuid

import pytest

from benchmarks._support.workload import payload
from kvtierd import errors
from kvtierd.client import KVClient
from tests.fault.remote_setup import put_on_remote, settle, size_of

pytestmark = [pytest.mark.redis, pytest.mark.slow]
SHARED = [f"shared-{i}" for i in range(6)]


def test_b_started_after_a_loads_a_remote_context(remote_daemon, cluster):
    ns = f"two-{uuid.uuid4().hex[:8]}"
    a = remote_daemon("a", ns)
    with KVClient(a.socket_path, timeout_s=30) as ca:
        put_on_remote(ca, SHARED)
        ca.put("a-local", payload("a-local", 4096), context_id="a-local")  # stays on A's cpu
        settle(ca)
    b = remote_daemon("b", ns)
    with KVClient(b.socket_path, timeout_s=30) as cb, KVClient(a.socket_path) as ca:
        assert all(cb.lookup(SHARED).found)
        for key in SHARED:
            assert bytes(cb.get(key)) == payload(key, size_of(key)), key
        # Local tiers stay each daemon's own.
        assert cb.lookup(["a-local"]).found == (False,)
        with pytest.raises(errors.NotFoundError):
            cb.get("a-local")
        cb.put("b-local", payload("b-local", 4096), context_id="b-local")
        assert ca.lookup(["b-local"]).found == (False,)
        b_tiers = {t.name: t for t in cb.tiers()}
        a_tiers = {t.name: t for t in ca.tiers()}
        assert a_tiers["cpu"].object_count >= 1 and b_tiers["ssd"].object_count == 0
        # B loading (and promoting) the shared contexts took nothing away from A.
        settle(cb)
        for key in SHARED:
            assert bytes(ca.get(key)) == payload(key, size_of(key)), key


def test_b_already_running_finds_what_a_places_later(remote_daemon, cluster):
    """B's index learns of A's object on a miss (not only by the SCAN at start); an object A
    deletes after B indexed it is a miss for B, never stale or wrong bytes."""
    ns = f"two-{uuid.uuid4().hex[:8]}"
    a = remote_daemon("a", ns)
    b = remote_daemon("b", ns)
    with KVClient(a.socket_path, timeout_s=30) as ca, KVClient(b.socket_path, timeout_s=30) as cb:
        put_on_remote(ca, [*SHARED, "gone"])
        assert cb.lookup(SHARED).found == (True,) * len(SHARED)
        for key in SHARED:
            assert bytes(cb.get(key)) == payload(key, size_of(key)), key
        assert cb.lookup(["gone"]).found == (True,)  # indexed by B, bytes still on the remote
        assert ca.delete(["gone"]) == 1
        with pytest.raises(errors.NotFoundError):
            cb.get("gone")
