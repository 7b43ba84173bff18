"""bench_e2e's end-of-run view of a kvtierd system comes from the daemon itself: each tier's
used bytes against its capacity, and each context's form, tier, hits and the placer's reason
(RESULTS.md reads misses and capacity from it). A real daemon on a real socket."""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.bench_e2e import _daemon_view
from kvtierd.client import KVClient
from tests.daemon_proc import DaemonProcess


def test_the_view_is_the_daemons_accounting(start_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = start_daemon(cpu="1MiB", ssd="4MiB")
    with KVClient(daemon.socket_path) as client:
        for i in range(3):
            client.put(f"doc-{i}", bytes(100_000), context_id="doc")
        client.put("other-0", bytes(50_000), context_id="other")
    view = _daemon_view(daemon.socket_path)
    assert {name: t["capacity"] for name, t in view["tiers"].items()} == {
        "cpu": 1 << 20, "ssd": 4 << 20,
    }  # fmt: skip
    assert sum(t["used"] for t in view["tiers"].values()) == 350_000
    by_id = {c["context"]: c for c in view["contexts"]}
    assert set(by_id) == {"doc", "other"}
    assert by_id["doc"]["size_bytes"] == 300_000 and by_id["doc"]["variant"] == "none"
    assert all(c["tier"] in view["tiers"] and c["reason"] for c in view["contexts"])
