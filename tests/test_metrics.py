"""Metrics: exact sample values through a real HTTP scrape; registries are per instance."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtierd.metrics import Metrics, VariantLabels


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture
def metrics() -> Iterator[Metrics]:
    m = Metrics()
    yield m
    m.close()


def test_scrape_over_http(metrics: Metrics) -> None:
    metrics.set_tier_state("cpu", used_bytes=300, objects=3, capacity_bytes=1000)
    metrics.set_tier_state("ssd", used_bytes=0, objects=0, capacity_bytes=5000, healthy=False)
    metrics.record_hit("cpu")
    metrics.record_hit("cpu")
    metrics.record_hit("ssd")
    metrics.record_miss()
    metrics.observe_load("cpu", 0.002, 4096)
    metrics.observe_store("ssd", 0.2, 8192)
    metrics.record_placement("knorm@0.5+int8", "ssd")
    metrics.record_placement("none", None)
    metrics.record_operation("move")
    metrics.record_error("NOT_FOUND")
    metrics.observe_profile_run(12.0, ok=False)
    metrics.set_healthy(True)
    port = metrics.start_http_server(0)
    assert port > 0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        got = samples(resp.read().decode())
    assert got[("kvtierd_tier_used_bytes", (("tier", "cpu"),))] == 300
    assert got[("kvtierd_tier_capacity_bytes", (("tier", "ssd"),))] == 5000
    assert got[("kvtierd_tier_objects", (("tier", "cpu"),))] == 3
    assert got[("kvtierd_tier_healthy", (("tier", "ssd"),))] == 0
    assert got[("kvtierd_hits_total", (("tier", "cpu"),))] == 2
    assert got[("kvtierd_misses_total", ())] == 1
    assert got[("kvtierd_tier_hit_ratio", (("tier", "cpu"),))] == pytest.approx(0.5)
    assert got[("kvtierd_tier_hit_ratio", (("tier", "ssd"),))] == pytest.approx(0.25)
    assert got[("kvtierd_load_seconds_count", (("tier", "cpu"),))] == 1
    assert got[("kvtierd_load_seconds_bucket", (("le", "0.0025"), ("tier", "cpu")))] == 1
    assert got[("kvtierd_load_seconds_bucket", (("le", "0.001"), ("tier", "cpu")))] == 0
    assert got[("kvtierd_load_bytes_total", (("tier", "cpu"),))] == 4096
    assert got[("kvtierd_store_bytes_total", (("tier", "ssd"),))] == 8192
    key = (("method", "knorm+int8"), ("ratio", "0.5"), ("tier", "ssd"))
    assert got[("kvtierd_placements_total", key)] == 1
    dropped = (("method", "none"), ("ratio", "1"), ("tier", "dropped"))
    assert got[("kvtierd_placements_total", dropped)] == 1
    assert got[("kvtierd_plan_operations_total", (("kind", "move"),))] == 1
    assert got[("kvtierd_errors_total", (("code", "NOT_FOUND"),))] == 1
    assert got[("kvtierd_profiler_runs_total", (("outcome", "failed"),))] == 1
    assert got[("kvtierd_profiler_run_seconds_sum", ())] == 12.0
    assert got[("kvtierd_healthy", ())] == 1


def test_hit_ratio_follows_later_lookups(metrics: Metrics) -> None:
    metrics.record_hit("cpu")
    got = samples(metrics.render().decode())
    assert got[("kvtierd_tier_hit_ratio", (("tier", "cpu"),))] == 1.0
    metrics.record_miss()
    metrics.record_miss()
    metrics.record_miss()
    got = samples(metrics.render().decode())
    assert got[("kvtierd_tier_hit_ratio", (("tier", "cpu"),))] == 0.25


def test_placed_contexts_are_replaced_not_accumulated(metrics: Metrics) -> None:
    metrics.set_placed_contexts({("int8", "cpu"): 3, ("knorm@0.3", "ssd"): 2})
    metrics.set_placed_contexts({("int8", "cpu"): 1})
    got = samples(metrics.render().decode())
    placed = {k: v for k, v in got.items() if k[0] == "kvtierd_placed_contexts"}
    assert placed == {
        ("kvtierd_placed_contexts", (("method", "int8"), ("ratio", "1"), ("tier", "cpu"))): 1
    }


def test_registries_are_independent() -> None:
    a, b = Metrics(), Metrics()
    a.record_miss()
    assert samples(b.render().decode())[("kvtierd_misses_total", ())] == 0
    assert samples(a.render().decode())[("kvtierd_misses_total", ())] == 1


def test_second_http_server_is_refused_and_close_frees_the_port(metrics: Metrics) -> None:
    port = metrics.start_http_server(0)
    with pytest.raises(RuntimeError, match="already running"):
        metrics.start_http_server(0)
    metrics.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


@pytest.mark.parametrize(
    ("variant", "method", "ratio"),
    [
        ("none", "none", "1"),
        ("", "none", "1"),
        ("int4", "int4", "1"),
        ("knorm@0.5", "knorm", "0.5"),
        ("snapkv@0.25+int8", "snapkv+int8", "0.25"),
    ],
)
def test_variant_labels(variant: str, method: str, ratio: str) -> None:
    assert VariantLabels.of(variant) == VariantLabels(method, ratio)
