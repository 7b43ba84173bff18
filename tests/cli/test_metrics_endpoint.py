"""The daemon's /metrics endpoint (``metrics_port: any``, the bound port read from its log),
scraped over HTTP after real traffic; what ``metrics_port`` accepts."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks._support.daemon_proc import DaemonProcess, metrics_port, write_config
from kvtierd.client import KVClient
from kvtierd.config import load_daemon_config
from kvtierd.errors import ConfigError


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
    d = start_daemon(cpu="4MiB", metrics_port="any")
    port = metrics_port(d)
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


@pytest.mark.parametrize("value", ["auto", -1, 65536, True, "9400"])
def test_metrics_port_names_what_it_allows(tmp_path: Path, value: object) -> None:
    with pytest.raises(ConfigError, match=r"metrics_port: expected 0 \(off\), a port 1-65535 or"):
        load_daemon_config(write_config(tmp_path, metrics_port=value))


@pytest.mark.parametrize("value", [0, 9400, "any"])
def test_metrics_port_takes_off_a_port_or_any(tmp_path: Path, value: object) -> None:
    assert load_daemon_config(write_config(tmp_path, metrics_port=value)).metrics_port == value
