"""Issue 40.7: every path that moves bytes obeys the tenants' quotas, the shutdown flush too.
A tenant with a 1 MiB SSD quota held 8 MiB on the SSD tier after a graceful restart."""

from __future__ import annotations

import time

from benchmarks._support.workload import payload
from kvtierd.client import KVClient

MiB = 1 << 20


def _settle(c: KVClient) -> None:
    deadline = time.monotonic() + 30
    while c.status().pending_plans and time.monotonic() < deadline:
        time.sleep(0.05)


def test_the_shutdown_flush_keeps_each_tenants_ssd_quota(start_daemon):
    tenants = [{"name": "a", "quota": {"cpu": "16MiB", "ssd": "1MiB"}}, {"name": "b"}]
    d = start_daemon(cpu="64MiB", ssd="256MiB", tenants=tenants, shutdown_flush_s=30)
    keys = [f"k{i}" for i in range(8)]
    for tenant in ("a", "b"):
        with KVClient(d.socket_path, tenant=tenant, timeout_s=30) as c:
            for key in keys:
                c.put(key, payload(key, MiB), context_id=key)
            _settle(c)
            assert {x.tier for x in c.contexts()} == {"cpu"}
    assert d.stop() == 0  # SIGTERM: the flush writes the CPU tier's contexts to the SSD tier
    d.start()
    with KVClient(d.socket_path, tenant="a", timeout_s=30) as a:
        # (ListContexts is an Admin call: on the trusted Unix socket it lists every tenant's)
        kept = [x for x in a.contexts() if x.tier == "ssd" and x.context_id.startswith("a/")]
        assert sum(x.size_bytes for x in kept) <= MiB, [(x.context_id, x.size_bytes) for x in kept]
        assert len(kept) == 1  # the quota is used, not left empty
    with KVClient(d.socket_path, tenant="b", timeout_s=30) as b:  # no quota: all kept
        assert b.lookup(keys).found == (True,) * len(keys)
