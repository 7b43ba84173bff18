"""A durable object moved past its persistent copy leaves no copy behind.

A durable commit to the CPU tier writes the object through to the first persistent tier (the
SSD tier here), uncharged. When the placer moves the context from the CPU tier straight to
another persistent tier (the remote store: the SSD tier is too small for the whole context),
the SSD copy must go once the remote copy is written. It once stayed: a file on disk nobody
was charged for, found at the next start beside the remote copy ("found in two tiers").
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from benchmarks._support.workload import payload
from kvtierd.client import KVClient

pytestmark = [pytest.mark.redis, pytest.mark.slow]

KiB = 1 << 10
OBJECT_BYTES = 48 * KiB  # two make a context larger than the SSD tier, each fits alone


def _settle(c: KVClient) -> None:
    deadline = time.monotonic() + 20
    while c.status().pending_plans and time.monotonic() < deadline:
        time.sleep(0.02)


def _objects_on_disk(ssd_root: Path) -> list[Path]:
    return sorted(p for p in (ssd_root / "objects").rglob("*") if p.is_file())


def test_a_durable_context_moved_to_the_remote_tier_leaves_no_ssd_copy(start_daemon, redis_cluster):
    remote = {
        "name": "remote", "kind": "remote", "capacity": "64MiB",
        "options": {"nodes": redis_cluster.addresses,
                    "namespace": f"durable-moves-{uuid.uuid4().hex[:12]}"},
    }  # fmt: skip
    d = start_daemon(cpu="128KiB", ssd="64KiB", extra_tiers=[remote], shutdown_flush_s=0)
    ssd_root = d.config.parent / "ssd"
    keys = ["doc-0", "doc-1"]
    with KVClient(d.socket_path, timeout_s=20) as c:
        c.put(keys[0], payload(keys[0], OBJECT_BYTES), context_id="doc", durable=True)
        # Read, so the second durable commit finds room on the SSD tier for its copy.
        assert bytes(c.get(keys[0])) == payload(keys[0], OBJECT_BYTES)
        c.put(keys[1], payload(keys[1], OBJECT_BYTES), context_id="doc", durable=True)
        _settle(c)
        assert {x.context_id: x.tier for x in c.contexts()} == {"doc": "cpu"}
        assert len(_objects_on_disk(ssd_root)) == 2  # the write-through copies

        # A volatile context overflows the CPU tier: "doc", least recently used and larger
        # than the SSD tier, moves on to the remote one.
        c.put("other", payload("other", 64 * KiB), context_id="other")
        _settle(c)
        assert {x.context_id: x.tier for x in c.contexts()} == {"doc": "remote", "other": "cpu"}
        ssd = next(t for t in c.tiers() if t.name == "ssd")
        assert (ssd.object_count, ssd.used_bytes) == (0, 0)
        assert _objects_on_disk(ssd_root) == []
    assert d.stop() == 0
    d.start()
    with KVClient(d.socket_path, timeout_s=20) as c:
        assert {x.context_id: x.tier for x in c.contexts()} == {"doc": "remote"}
        for key in keys:
            assert bytes(c.get(key)) == payload(key, OBJECT_BYTES)
    assert "found in two tiers" not in d.logs()
