"""bench_e2e's end-of-run view of a kvtierd system comes from the daemon itself: each tier's
used bytes against its capacity, and each context's form, tier, hits and the placer's reason
(RESULTS.md reads misses and capacity from it). A real daemon on a real socket."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from benchmarks._support.daemon_proc import DaemonProcess
from benchmarks.e2e.bench_e2e import _daemon_view
from kvtierd.client import KVClient


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


def test_profile_schedule_sets_the_daemons_runs_beside_the_requests(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    """Issue 26's two checks as bench_e2e measures them, on a real daemon's profile runs:
    contexts learned one put at a time (as the warm-up asks them), then requests placed
    before and after the runs."""
    from benchmarks.e2e.bench_e2e import _daemon_contexts, _profile_runs, profile_schedule
    from tests.daemon.test_profile_schedule import POLICY, _put, _until

    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    daemon = start_daemon(policy_file=str(policy))
    known: set[str] = set()
    ids, warmup = {}, []
    with KVClient(daemon.socket_path) as client:
        for c in (0, 1):
            warmup.append({"context": c, "sent_unix_s": time.time(), "ttft_s": 0.1,
                           "total_s": 0.2})  # fmt: skip
            _put(client, f"doc{c}")
            now = _daemon_contexts(daemon.socket_path)
            ids[str(c)], known = sorted(now - known), known | now
        _until(lambda: len([r for r in _runs(client) if r.ok]) == 2)
    runs = _profile_runs(daemon.socket_path)
    assert ids == {"0": ["doc0"], "1": ["doc1"]} and {r["kind"] for r in runs} == {"first"}
    first_start = min(r["started_unix_s"] for r in runs)
    last_end = max(r["ended_unix_s"] for r in runs)

    def result(start: float, length_s: float) -> dict[str, Any]:
        outcomes = [{"context": c, "sent_s": 0.0, "ttft_s": length_s / 2, "total_s": length_s}
                    for c in (0, 1)]  # fmt: skip
        return {"profile_runs": runs, "timed_start_unix_s": start, "wall_s": length_s,
                "outcomes": outcomes, "warmup": warmup, "daemon_ids": ids}  # fmt: skip

    after = profile_schedule(result(last_end + 1.0, 5.0))  # the timed run after the profiles
    assert after is not None
    assert (after["in_window"], after["beside_requests"], after["requests_beside"]) == (0, 0, 0)
    assert (after["contexts"], after["profiled_by_second"], after["late"]) == (2, 2, [])
    during = profile_schedule(result(first_start - 1.0, last_end - first_start + 2.0))
    assert during is not None  # both requests in flight across both runs: both late too
    assert (during["in_window"], during["beside_requests"], during["requests_beside"]) == (2, 2, 2)
    assert during["overlap_s"] == pytest.approx(2 * sum(r["ended_unix_s"] - r["started_unix_s"]
                                                        for r in runs))  # fmt: skip
    assert (during["profiled_by_second"], during["late"]) == (0, [0, 1])


def _runs(client: KVClient) -> list[Any]:
    from kvtierd.rpc import kvtier_pb2 as pb

    return list(client.call(client.admin.ProfileStatus, pb.ProfileStatusRequest()).runs)
