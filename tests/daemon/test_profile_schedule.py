"""When the daemon profiles (issue 26), on a real daemon over its socket: every context gets the
cheap estimator's profile after its first put — after the put is answered, without a single
query, trusted — so it has one before its second request; and no profile starts while a real
``kvtierd router`` has a request in flight at vLLM (a stand-in answers as vLLM, holding a
stream open), the signal the router reports (``KVStore.ReportInFlight``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks._support.daemon_proc import DaemonProcess
from kvtierd.client import KVClient
from kvtierd.errors import InvalidArgumentError
from kvtierd.integrations.router.app import ROUTER
from kvtierd.kernels.chunk_codec import ChunkFormat
from kvtierd.rpc import kvtier_pb2 as pb
from tests.integrations.test_router_errors import Upstream, _prompt, _router, upstream

L, H, D, T, CHUNKS = 2, 2, 32, 16, 4
POLICY = (
    "placer: evicpress\nvariants: {methods: [knorm], ratios: [1.0, 0.5]}\n"
    "profiling: {estimator: attention}\n"
)
__all__ = ["upstream"]  # a fixture


def _daemon(start_daemon: Callable[..., DaemonProcess], tmp_path: Path) -> DaemonProcess:
    policy = tmp_path / "evicpress.yaml"
    policy.write_text(POLICY)
    # the daemon's own reads count as serving only briefly: the router's count is the signal
    return start_daemon(policy_file=str(policy), profile_quiet_s=0.1)


def _put(client: KVClient, cid: str) -> float:
    """A context as the LMCache plugin stores it (bf16 chunks); when its put was answered."""
    layout = ChunkFormat((2, L, T, H * D), "bfloat16", H).layout()
    g = torch.Generator().manual_seed(len(cid))
    for i in range(CHUNKS):
        x = torch.randn(2, L, T, H * D, generator=g).to(torch.bfloat16)
        client.put(f"{cid}-{i}", x, context_id=cid, layout=layout, token_count=T)
    return time.time()


def _runs(client: KVClient) -> list[Any]:
    return list(client.call(client.admin.ProfileStatus, pb.ProfileStatusRequest()).runs)


def _until(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.1)


def test_every_context_is_profiled_after_its_first_put(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    daemon = _daemon(start_daemon, tmp_path)
    with KVClient(daemon.socket_path) as client:
        answered = {cid: _put(client, cid) for cid in ("a", "b", "c")}
        _until(lambda: {r.context_id for r in _runs(client) if r.ok} == set(answered))
        for run in _runs(client):
            assert (run.kind, run.evaluator) == ("first", "attention")
            assert run.started_unix_s >= answered[run.context_id]  # off the put's path
            assert run.started_unix_s <= run.ended_unix_s
        for cid in answered:  # no query was ever asked, and the profile is trusted
            status = client.call(
                client.admin.ProfileStatus, pb.ProfileStatusRequest(context_id=cid)
            )
            assert (status.profiled, status.trusted, status.estimator) == (True, True, "attention")
            qualities = {v.variant: v.quality for v in status.variants}
            assert 0 < qualities["knorm@0.5"] < 1


def test_a_report_is_validated_and_scoped(start_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = start_daemon()
    with KVClient(daemon.socket_path) as client:
        assert client.report_in_flight("router-1", 3) == 30.0
        for reporter, count in (("", 1), ("a/b", 1), ("r", 2_000_000)):
            with pytest.raises(InvalidArgumentError):
                client.report_in_flight(reporter, count)


async def test_no_profile_starts_while_the_router_has_a_request_in_flight(
    start_daemon: Callable[..., DaemonProcess],
    tmp_path: Path,
    upstream: tuple[Upstream, str],
) -> None:
    up, url = upstream
    daemon = _daemon(start_daemon, tmp_path)
    router = await _router(url, daemon.socket_path)
    try:
        up.finish.clear()  # vLLM holds the stream open after its events
        body = {"model": "m", "prompt": _prompt(40), "max_tokens": 3, "stream": True}
        request = asyncio.ensure_future(router.post("/v1/completions", json=body))
        reporter = router.server.app[ROUTER].in_flight
        await _async_until(lambda: reporter.reported == 1)
        with KVClient(daemon.socket_path) as client:
            await asyncio.to_thread(_put, client, "doc")
            await asyncio.sleep(3.0)  # settled long ago (0.5 s): held back by the request
            assert await asyncio.to_thread(_runs, client) == []
            up.finish.set()
            answer = await request
            await answer.read()
            ended = time.time()
            await _async_until(lambda: reporter.reported == 0)
            await asyncio.to_thread(_until, lambda: bool(_runs(client)))
            (run,) = await asyncio.to_thread(_runs, client)
            assert run.context_id == "doc" and run.ok and run.started_unix_s >= ended - 0.05
    finally:
        up.finish.set()
        await router.close()


async def _async_until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


async def test_a_profilers_scoped_request_is_not_counted(
    start_daemon: Callable[..., DaemonProcess],
    tmp_path: Path,
    upstream: tuple[Upstream, str],
) -> None:
    """The ``served`` evaluator's own requests (scoped) are the profile itself: counted, they
    would hold every other profile back while one runs."""
    up, url = upstream
    daemon = _daemon(start_daemon, tmp_path)
    router = await _router(url, daemon.socket_path)
    try:
        up.finish.clear()
        body = {"model": "m", "prompt": _prompt(40), "max_tokens": 3, "stream": True,
                "kvtierd": {"scope": "profile-1"}}  # fmt: skip
        request = asyncio.ensure_future(router.post("/v1/completions", json=body))
        await _async_until(lambda: len(up.bodies) == 1)  # at vLLM, held open
        assert router.server.app[ROUTER].in_flight.count == 0
        up.finish.set()
        await (await request).read()
    finally:
        up.finish.set()
        await router.close()
