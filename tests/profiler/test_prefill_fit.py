"""The prefill speed learned from served requests (issue 13.3): the TTFT model prices a
recompute at vLLM's own speed once requests have reported enough of it."""

from __future__ import annotations

import pytest

from kvtierd.client import KVClient
from kvtierd.errors import InvalidArgumentError
from kvtierd.profiler import TtftModel
from kvtierd.profiler.prefill_fit import MIN_SAMPLES, PrefillFit
from kvtierd.rpc import kvtier_pb2 as pb


def _feed(fit: PrefillFit, tokens_per_s: float, overhead_s: float, lengths: list[int]) -> None:
    for n in lengths:
        assert fit.observe(n, 0, overhead_s + n / tokens_per_s)


def test_the_line_through_misses_gives_rate_and_overhead() -> None:
    fit = PrefillFit()
    _feed(fit, 600.0, 0.3, [700, 1000, 1500, 2000, 3000, 3500, 4000, 900])
    learned = fit.estimate()
    assert learned is not None and learned.samples == 8
    assert learned.tokens_per_s == pytest.approx(600.0)
    assert learned.overhead_s == pytest.approx(0.3)


def test_no_estimate_until_enough_samples_of_different_lengths() -> None:
    fit = PrefillFit()
    _feed(fit, 600.0, 0.3, [1000] * (MIN_SAMPLES - 1))
    assert fit.estimate() is None  # too few
    _feed(fit, 600.0, 0.3, [1100] * 4)
    assert fit.samples == MIN_SAMPLES + 3 and fit.estimate() is None  # no spread to fit a slope
    _feed(fit, 600.0, 0.3, [2000])
    assert fit.estimate() is not None


def test_hits_and_tiny_prefills_are_not_samples() -> None:
    fit = PrefillFit()
    assert not fit.observe(2048, 1792, 0.4)  # mostly loaded: its TTFT is a load's
    assert not fit.observe(2048, 2040, 0.2)
    assert not fit.observe(40, 20, 0.1)  # 20 computed tokens: all overhead
    assert fit.observe(2048, 256, 3.0)  # a quarter at most cached: a prefill sample
    assert fit.samples == 1 and fit.reported == 4


@pytest.mark.parametrize(("prompt", "cached", "ttft", "why"), [
    (100, 101, 1.0, "cached_tokens must be between 0 and prompt_tokens"),
    (100, 0, 0.0, "ttft_s must be a number of seconds"),
    (100, 0, float("nan"), "ttft_s must be a number of seconds"),
    (100, 0, 1e9, "ttft_s must be a number of seconds"),
])  # fmt: skip
def test_bad_reports_are_refused_by_name(prompt: int, cached: int, ttft: float, why: str) -> None:
    with pytest.raises(InvalidArgumentError, match=why):
        PrefillFit().observe(prompt, cached, ttft)


def test_the_ttft_model_switches_from_configured_to_learned() -> None:
    model = TtftModel(prefill_tokens_per_s=5000.0)
    assert model.prefill_s(3000) == pytest.approx(0.6)
    _feed(model.fit, 500.0, 0.25, [600, 1200, 1800, 2400, 3000, 3600, 4200, 4800])
    assert model.prefill_s(3000) == pytest.approx(
        6.0
    )  # the slope only: overhead is paid by hits too


def test_report_served_over_the_socket(start_daemon) -> None:
    d = start_daemon()
    with KVClient(d.socket_path) as c:
        assert c.status().prefill_samples == 0 and not c.status().prefill_learned
        configured = c.status().prefill_tokens_per_s
        for n in (500, 1000, 1500, 2000, 2500, 3000, 3500, 4000):
            req = pb.ReportServedRequest(
                prompt_tokens=n + 16, cached_tokens=16, ttft_s=0.2 + n / 800
            )
            assert c.call(c.kv.ReportServed, req).prefill_sample
        hit = pb.ReportServedRequest(prompt_tokens=4096, cached_tokens=3840, ttft_s=0.5)
        reply = c.call(c.kv.ReportServed, hit)
        assert not reply.prefill_sample and reply.prefill_tokens_per_s == pytest.approx(800.0)
        status = c.status()
        assert status.prefill_learned and status.prefill_samples == 8
        assert status.prefill_tokens_per_s == pytest.approx(800.0) != configured
        assert status.prefill_overhead_s == pytest.approx(0.2)
        bad = pb.ReportServedRequest(prompt_tokens=10, cached_tokens=11, ttft_s=1.0)
        with pytest.raises(
            InvalidArgumentError, match="cached_tokens must be between 0 and prompt_tokens"
        ):
            c.call(c.kv.ReportServed, bad)
