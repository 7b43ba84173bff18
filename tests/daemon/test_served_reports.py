"""Issue 27.1: ReportServed cannot poison placement. Reports are checked against what a
server can do, the fit is robust (Theil-Sen), a named tenant's reports go to a window of its
own (they price nobody else's contexts) and are rate-limited. Tenant a over the Unix socket,
tenant b (no admin) over TCP, the default tenant (the router's) over the socket."""

from __future__ import annotations

import contextlib

import pytest

from benchmarks._support.daemon_proc import tcp_listener
from kvtierd import errors
from kvtierd.client import KVClient
from kvtierd.profiler.prefill_fit import REPORT_BURST
from kvtierd.rpc import kvtier_pb2 as pb

LENGTHS = (500, 1000, 1500, 2000, 2500, 3000, 3500, 4000)


def _report(c: KVClient, prompt: int, ttft_s: float, cached: int = 0) -> pb.ReportServedResponse:
    req = pb.ReportServedRequest(prompt_tokens=prompt, cached_tokens=cached, ttft_s=ttft_s)
    return c.call(c.kv.ReportServed, req)


def _poison(c: KVClient, n: int = 256) -> None:
    """The issue's crafted reports: a long prompt in very little time, many times over."""
    for i in range(n):
        with contextlib.suppress(errors.InvalidArgumentError):  # those the bounds refuse
            _report(c, 4000 + 64 * (i % 8), 0.0125 + 1e-4 * (i % 8))


def test_a_tenant_cannot_move_the_prefill_speed_of_others(start_daemon, tmp_path):
    tcp = tcp_listener(tmp_path, "admin-token")
    (tmp_path / "b.token").write_text("b-token")
    tenants = [{"name": "a"}, {"name": "b", "token_file": str(tmp_path / "b.token")}]
    d = start_daemon(tenants=tenants, **tcp.settings)
    with (
        KVClient(d.socket_path) as router,
        KVClient(d.socket_path, tenant="a") as a,
        KVClient(address=tcp.address(d), tls_ca_file=str(tcp.ca_file), token="b-token") as b,
    ):
        configured = router.status().prefill_tokens_per_s
        for c in (a, b):
            _poison(c)
        assert router.status().prefill_tokens_per_s == configured  # nothing learned from them
        for n in LENGTHS:  # the router's own reports: 800 tokens/s, 0.2 s overhead
            assert _report(router, n + 16, 0.2 + n / 800, cached=16).prefill_sample
        assert router.status().prefill_tokens_per_s == pytest.approx(800.0)
        for c in (a, b):
            _poison(c)
        assert router.status().prefill_tokens_per_s == pytest.approx(800.0)
        # a tenant sees its own fit (it learned what it reported), nobody else does
        assert _report(b, 4096, 0.5, cached=3840).prefill_tokens_per_s != pytest.approx(800.0)


@pytest.mark.parametrize(
    ("prompt", "ttft", "why"),
    [
        (4000, 5e-324, "ttft_s must be a number of seconds"),  # denormal: 1/slope was inf
        (4000, 1e-300, "ttft_s must be a number of seconds"),
        ((1 << 64) - 1, 1.0, "prompt_tokens must be at most"),
        (4_000_000, 0.01, "faster than any server"),
    ],
)
def test_implausible_reports_are_refused_by_name(start_daemon, tmp_path, prompt, ttft, why):
    tcp = tcp_listener(tmp_path, "admin-token")
    d = start_daemon(**tcp.settings)
    with (
        KVClient(d.socket_path) as local,
        KVClient(address=tcp.address(d), tls_ca_file=str(tcp.ca_file), token="admin-token") as r,
    ):
        for c in (local, r):
            with pytest.raises(errors.InvalidArgumentError, match=why):
                _report(c, prompt, ttft)
        assert local.status().prefill_samples == 0


def test_a_minority_of_outliers_does_not_move_the_fit(start_daemon):
    d = start_daemon()
    with KVClient(d.socket_path) as router:
        for _ in range(3):
            for n in LENGTHS:
                _report(router, n, 0.2 + n / 800)
        for i in range(10):  # 10 of 34 samples: as fast as the bounds allow, or very slow
            _report(router, 4000, 0.001 + 4000 / 9e6 if i % 2 else 300.0)
        assert router.status().prefill_tokens_per_s == pytest.approx(800.0, rel=0.1)


def test_reports_are_rate_limited_per_tenant(start_daemon):
    d = start_daemon(tenants=[{"name": "a"}, {"name": "b"}])
    with KVClient(d.socket_path, tenant="a") as a, KVClient(d.socket_path, tenant="b") as b:
        with pytest.raises(errors.CapacityError, match="faster than"):
            for _ in range(2 * REPORT_BURST):
                _report(a, 4096, 0.5, cached=3840)
        assert not _report(b, 4096, 0.5, cached=3840).prefill_sample  # b's allowance is its own
