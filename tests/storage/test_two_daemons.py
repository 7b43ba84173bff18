"""Two daemons share one Redis Cluster remote tier: a context daemon A stored (and moved down
to the remote tier) is found and loaded by daemon B, whose index never saw it; each daemon's
local tiers stay its own."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvtierd.client import KVClient
from kvtierd.rpc import kvtier_pb2 as pb

pytestmark = pytest.mark.redis


def _remote(cluster, namespace: str) -> dict:
    return {
        "name": "remote",
        "kind": "remote",
        "capacity": 0,
        # a lookup asks about keys the other daemon stored within lookup_budget_s: a loaded
        # machine's Redis may answer slower than the default 50 ms
        "options": {
            "nodes": cluster.addresses,
            "namespace": namespace,
            "value_bytes": 1 << 20,
            "lookup_budget_s": 5.0,
        },
    }


def _settle(c: KVClient) -> None:
    deadline = time.monotonic() + 10
    while c.status().pending_plans and time.monotonic() < deadline:
        time.sleep(0.01)


def test_context_stored_by_a_is_loaded_by_b(start_daemon, redis_cluster):
    tiers = [_remote(redis_cluster, "two-daemons")]
    a = start_daemon("a", extra_tiers=tiers)
    b = start_daemon("b", extra_tiers=tiers)
    x = np.random.default_rng(3).standard_normal((2, 4, 64, 256)).astype(np.float16)
    with KVClient(a.socket_path) as ca:
        ca.put("doc/0", x, context_id="doc")
        ca.put("local-only", b"a's", context_id="mine")
        assert ca.drain("cpu").moved == 2
        _settle(ca)
        # Only the shared context goes on down to the remote tier.
        ca.call(ca.admin.Evict, pb.EvictRequest(context_ids=["mine"]))
        assert ca.drain("ssd").moved == 1
        assert ca.lookup(["doc/0"]).tiers == ("remote",)
    with KVClient(b.socket_path) as cb:
        assert cb.status().objects == 0  # B's index has never seen A's objects
        r = cb.lookup(["doc/0", "local-only"])
        assert r.found == (True, False)
        assert r.tiers[0] == "remote"
        assert np.array_equal(cb.get("doc/0"), x)
        (ctx,) = [c for c in cb.contexts() if c.context_id == "doc"]
        assert ctx.objects == 1
