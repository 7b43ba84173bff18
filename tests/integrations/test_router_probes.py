"""The router's probes (issue 41): liveness is the router answering, readiness is vLLM
answering, and the daemon's state is its own field and metric. A real ``kvtierd router``
process, a real daemon started and killed under it; vLLM is the HTTP stand-in of
``test_router_errors.py`` (the probes ask vLLM only ``/health``), closed to take vLLM away."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp")
import aiohttp
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from benchmarks._support.daemon_proc import DaemonProcess
from tests.integrations.test_router_errors import Upstream, _bound_port

TOKEN = "s3cret-token"


async def _get(http: aiohttp.ClientSession, url: str, **kw: Any) -> tuple[int, Any]:
    async with http.get(url, **kw) as r:
        if r.content_type == "application/json":
            return r.status, await r.json()
        return r.status, await r.text()


def _metrics(text: str) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


async def _until(what: str, probe: Callable[[], Any], timeout_s: float = 60.0) -> None:
    """Poll ``probe`` (async, truthy when done); the daemon's field follows within ~1 s."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await probe():
        assert asyncio.get_running_loop().time() < deadline, f"{what} within {timeout_s} s"
        await asyncio.sleep(0.1)


async def test_ready_while_vllm_answers_whatever_the_daemon(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    up = Upstream()
    vllm = TestServer(up.app())
    await vllm.start_server()
    sock = tmp_path / "d" / "kvtierd.sock"  # where start_daemon puts the daemon "d"
    log, port_file, token = tmp_path / "router.log", tmp_path / "router.port", tmp_path / "tok"
    token.write_text(TOKEN + "\n")
    with log.open("wb") as out:
        router = subprocess.Popen(
            [sys.executable, "-m", "kvtierd.main", "router", "--upstream",
             str(vllm.make_url("")).rstrip("/"), "--port", "0", "--port-file", str(port_file),
             "--socket", str(sock), "--token-file", str(token)],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        base = f"http://127.0.0.1:{await _bound_port(router, port_file, log)}"
        async with aiohttp.ClientSession() as http:
            await _until("the router listening", lambda: _answers(http, f"{base}/livez"))
            # No daemon yet: alive and ready (it serves every request from its real prompt).
            assert await _get(http, f"{base}/livez") == (200, {"status": "alive"})
            status, ready = await _get(http, f"{base}/readyz")  # no token: a kubelet probe
            assert (status, ready["status"], ready["upstream"]) == (200, "ready", True)
            assert ready["daemon"].startswith("unreachable: "), ready
            status, health = await _get(http, f"{base}/health", headers=auth)
            assert (status, health["daemon"], health["lookup_errors"]) == (200, ready["daemon"], 0)
            status, text = await _get(http, f"{base}/metrics", headers=auth)
            assert status == 200
            assert _metrics(text)["kvtierd_router_daemon_up"] == 0
            assert _metrics(text)["kvtierd_router_upstream_up"] == 1
            # Counters and state stay behind the token.
            assert (await _get(http, f"{base}/health"))[0] == 401
            assert (await _get(http, f"{base}/metrics"))[0] == 401

            daemon = await asyncio.to_thread(start_daemon)  # its wait blocks
            assert daemon.socket_path == str(sock)

            async def daemon_up() -> bool:
                _, text = await _get(http, f"{base}/metrics", headers=auth)
                return _metrics(text)["kvtierd_router_daemon_up"] == 1

            await _until("kvtierd_router_daemon_up 1", daemon_up)
            status, ready = await _get(http, f"{base}/readyz")
            assert (status, ready["daemon"]) == (200, "SERVING")

            daemon.kill()
            await _until("kvtierd_router_daemon_up 0", lambda: _not(daemon_up()))
            assert (await _get(http, f"{base}/readyz"))[0] == 200

            await vllm.close()  # vLLM away: not ready, still alive
            status, ready = await _get(http, f"{base}/readyz")
            assert (status, ready["status"], ready["upstream"]) == (503, "not ready", False)
            assert "vLLM at" in ready["upstream_error"]
            assert (await _get(http, f"{base}/livez"))[0] == 200
            _, text = await _get(http, f"{base}/metrics", headers=auth)
            assert _metrics(text)["kvtierd_router_upstream_up"] == 0
    finally:
        router.terminate()
        router.wait(30)
        await vllm.close()
    assert "Traceback" not in log.read_text()


async def _answers(http: aiohttp.ClientSession, url: str) -> bool:
    try:
        return (await _get(http, url))[0] == 200
    except aiohttp.ClientError:
        return False


async def _not(value: Any) -> bool:
    return not await value
