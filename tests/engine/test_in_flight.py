"""Routers' reports of vLLM's requests in flight (``engine/in_flight_reports.py``): per tenant and
reporter, bounded, validated, and a nonzero count lapses unless reported again."""

from __future__ import annotations

import pytest

from kvtierd.engine.in_flight_reports import (
    MAX_IN_FLIGHT,
    MAX_REPORTERS_PER_TENANT,
    InFlightReports,
)
from kvtierd.errors import InvalidArgumentError


def test_counts_add_up_across_reporters_and_tenants_and_lapse() -> None:
    now = [0.0]
    reports = InFlightReports(hold_s=30.0, clock=lambda: now[0])
    assert not reports.busy
    reports.report("a", "router-1", 2)
    reports.report("b", "router-1", 1)  # another tenant's router of the same name: its own
    assert reports.in_flight() == 3
    reports.report("a", "router-1", 0)
    assert reports.in_flight() == 1 and reports.busy
    now[0] = 30.0  # b's router went without reporting its end
    assert not reports.busy


def test_a_tenant_keeps_a_bounded_number_of_reporters() -> None:
    reports = InFlightReports()
    for i in range(MAX_REPORTERS_PER_TENANT + 1):
        reports.report("a", f"r{i}", 1)
    assert reports.in_flight() == MAX_REPORTERS_PER_TENANT  # the oldest was replaced


@pytest.mark.parametrize(
    ("reporter", "count", "match"),
    [("", 1, "reporter must be"), ("a" * 65, 1, "reporter must be"),
     ("r/1", 1, "reporter must be"), ("r", MAX_IN_FLIGHT + 1, "in_flight must be between")],
)  # fmt: skip
def test_bad_reports_are_refused(reporter: str, count: int, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        InFlightReports().report("a", reporter, count)
