"""Short versions of benchmarks/micro/bench_load.py: many client processes x mixed operations, every
read verified against its deterministic payload; then the same under daemon restarts (SIGKILL
and SIGTERM in turn): clients see only kvtierd errors, reconnect, and every durable put they
had acknowledged - through the arena or streamed (issue 16.1) - reads back whole."""

from __future__ import annotations

import pytest

from benchmarks.micro.bench_load import LoadConfig, report, run_load

pytestmark = pytest.mark.slow


def test_mixed_load_loses_and_corrupts_nothing(start_daemon):
    d = start_daemon(cpu="16MiB", ssd="1GiB")
    r = run_load(d, LoadConfig(clients=8, seconds=12, max_bytes=192 << 10, live=32))
    print(report(r))
    assert not r.lost and not r.corrupt, (r.lost[:10], r.corrupt[:10])
    assert not r.other_errors, r.other_errors[:5]
    assert r.ops > 8 * 100 and r.bytes_verified > 50 << 20, report(r)
    ops = {"get", "get_stream", "put", "put_stream", "put_durable", "put_stream_durable", "delete"}
    assert ops <= set(r.latency_ms)


def test_daemon_restarts_under_load(start_daemon):
    d = start_daemon(cpu="16MiB", ssd="1GiB")
    cfg = LoadConfig(clients=4, seconds=20, max_bytes=192 << 10, live=32, restart_every_s=4.5,
                     min_restarts=3)  # fmt: skip
    r = run_load(d, cfg)
    print(report(r))
    assert r.restarts_injected >= 3 and r.restarts_survived == r.restarts_injected
    assert r.clean_errors > 0, "the clients should have seen the daemon go away"
    assert not r.other_errors, r.other_errors[:5]  # only kvtierd errors, never raw ones
    assert not r.lost and not r.corrupt, (r.lost[:10], r.corrupt[:10])
    assert r.durable_acknowledged > 0 and r.bytes_verified > 0
