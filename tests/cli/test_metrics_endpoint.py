"""The daemon's /metrics endpoint (``metrics_port``), scraped over HTTP after real traffic."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtierd.client import KVClient
from tests.daemon_proc import DaemonProcess, free_port


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    deadline = time.monotonic() + 5
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                text = r.read().decode()
            break
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_scraped_after_traffic(start_daemon: Callable[..., DaemonProcess]) -> None:
    port = free_port()
    d = start_daemon(cpu="4MiB", metrics_port=port)
    with KVClient(d.socket_path) as c:
        c.put("k", np.zeros(4096, dtype=np.uint8), context_id="doc")
        c.get("k")
        with pytest.raises(KeyError):
            c.get("missing")
    got = scrape(port)
    assert got[("kvtierd_tier_capacity_bytes", (("tier", "cpu"),))] == 4 << 20
    assert got[("kvtierd_tier_used_bytes", (("tier", "cpu"),))] == 4096
    assert got[("kvtierd_tier_objects", (("tier", "cpu"),))] == 1
    assert got[("kvtierd_hits_total", (("tier", "cpu"),))] == 1
    assert got[("kvtierd_load_seconds_count", (("tier", "cpu"),))] == 1
    assert got[("kvtierd_store_bytes_total", (("tier", "cpu"),))] == 4096
    placed = (("method", "none"), ("ratio", "1"), ("tier", "cpu"))
    assert got[("kvtierd_placements_total", placed)] == 1
    assert got[("kvtierd_plan_operations_total", (("kind", "place"),))] >= 1
    assert got[("kvtierd_errors_total", (("code", "NOT_FOUND"),))] == 1
    assert got[("kvtierd_healthy", ())] == 1
