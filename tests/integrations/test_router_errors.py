"""How ``kvtierd router`` answers when a request, the daemon or vLLM is not what it expects, on
a real router app and a real (absent) daemon socket, without vLLM: a small HTTP stand-in
answers the four vLLM endpoints the router calls and records what reaches it.

The daemon is optional for serving: a request the router cannot look up goes out as the real
prompt (always safe: only a placeholder prompt must never be prefilled), while a store request,
which needs the daemon, is refused with the reason."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp")
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvtierd.integrations.router.app import ROUTER, RouterConfig, make_app

ANSWER = {"id": "c1", "object": "text_completion",
          "choices": [{"index": 0, "text": " w1", "finish_reason": "length"}]}  # fmt: skip


class Upstream:
    """``/v1/models``, ``/tokenize``, ``/v1/completions`` and ``/health`` as vLLM answers them
    (word-level tokenizer: ``wN`` is token ``N + 3``); keeps the completion bodies it got."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.finish = asyncio.Event()
        self.finish.set()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_get("/health", self.health)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "root": "/models/m"}]})

    async def tokenize(self, request: web.Request) -> web.Response:
        words = str((await request.json())["prompt"]).split()
        return web.json_response({"tokens": [int(w[1:]) + 3 for w in words]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        if self.bodies[-1].get("stream"):
            return await self.stream(request)
        return web.json_response(ANSWER)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """vLLM's stream: a few events and ``data: [DONE]``; the rest of the stream (here a
        blank line, as vLLM ends each event) once :attr:`finish` is set."""
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for _ in range(3):
            await out.write(b'data: {"choices": [{"index": 0, "text": " w1"}]}\n\n')
        await out.write(b"data: [DONE]\n")
        await self.finish.wait()
        await out.write(b"\n")
        await out.write_eof()
        return out


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[Upstream, str]]:
    up = Upstream()
    async with TestServer(up.app()) as server:
        yield up, str(server.make_url("")).rstrip("/")


async def _router(
    upstream_url: str, socket_path: str, lookup_timeout_s: float = 2.0
) -> TestClient[Any, Any]:
    config = RouterConfig(
        upstream_url, socket_path, chunk_tokens=16, lookup_timeout_s=lookup_timeout_s
    )
    client: TestClient[Any, Any] = TestClient(TestServer(make_app(config)))
    await client.start_server()
    return client


def _prompt(n: int) -> str:
    return " ".join(f"w{i}" for i in range(n))


async def test_without_the_daemon_a_request_is_served_from_the_real_prompt(
    upstream: tuple[Upstream, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    up, url = upstream
    router = await _router(url, str(tmp_path / "no-daemon.sock"))
    try:
        body = {"model": "m", "prompt": _prompt(40), "max_tokens": 1}
        r = await router.post("/v1/completions", json=body)
        assert (r.status, await r.json()) == (200, ANSWER)
        assert up.bodies == [body]  # as sent: no placeholder ids, no tags
        assert "sending the real prompt" in caplog.text and "cannot reach kvtierd" in caplog.text
        assert router.server.app[ROUTER].lookup_errors == 1
        # Ready: it serves (issue 41: it answered 503, and a readiness probe took it out).
        health = await router.get("/health")
        assert health.status == 200
        state = await health.json()
        assert (state["status"], state["upstream"]) == ("ready", True)
        assert state["daemon"].startswith("unreachable: "), state
    finally:
        await router.close()


async def test_a_daemon_that_never_answers_holds_a_request_only_for_the_lookup_timeout(
    upstream: tuple[Upstream, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A hung daemon (its socket takes connections, nothing answers): the request goes out as
    the real prompt once ``lookup_timeout_s`` has passed, not after the client's 60 s."""
    up, url = upstream
    path = tmp_path / "hung.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as hung:
        hung.bind(str(path))
        hung.listen(64)  # connections queue in the kernel; nobody ever accepts them
        router = await _router(url, str(path), lookup_timeout_s=0.5)
        try:
            body = {"model": "m", "prompt": _prompt(40), "max_tokens": 1}
            t0 = time.monotonic()
            r = await router.post("/v1/completions", json=body)
            waited = time.monotonic() - t0
            assert (r.status, await r.json()) == (200, ANSWER)
            assert up.bodies == [body]
            assert waited < 10, f"held {waited:.1f} s"  # lookup 0.5 s + registration 1 s
            # The lookup times out (the client's connect waits up to CONNECT_TIMEOUT_MS for a
            # daemon that took the connection, so the lookup's own bound decides): the real
            # prompt went out at once.
            assert "kvtierd did not answer in 0.5 s" in caplog.text, caplog.text
            assert router.server.app[ROUTER].lookup_errors == 1
            # A profiler's scoped request is useless without its variant: it waits while the
            # lookup is pending; once the client gives up on the hung daemon it may be
            # answered, but never as the variant (the served evaluator scores only answers
            # that carry the variant's header).
            scoped = {**body, "kvtierd": {"scope": "p1", "variant": "knorm@0.5"}}
            try:
                late = await asyncio.wait_for(router.post("/v1/completions", json=scoped), 3.0)
            except TimeoutError:
                assert up.bodies == [body]
            else:
                assert "x-kvtierd-context" not in late.headers
        finally:
            await router.close()


async def test_without_the_daemon_a_store_request_is_refused_with_the_reason(
    upstream: tuple[Upstream, str], tmp_path: Path
) -> None:
    up, url = upstream
    router = await _router(url, str(tmp_path / "no-daemon.sock"))
    try:
        store = {"context_tokens": 32, "variant": "knorm@0.5"}
        body = {"model": "m", "prompt": _prompt(40), "kvtierd": store}
        r = await router.post("/v1/completions", json=body)
        assert r.status == 503
        assert "cannot reach kvtierd" in (await r.json())["error"]["message"]
        assert up.bodies == []  # vLLM never prefilled it
    finally:
        await router.close()


@pytest.mark.parametrize(
    ("store", "match"),
    [
        ({"context_tokens": 40, "variant": "knorm@0.5"}, "context_tokens=40: must be a multiple"),
        # whole 16-token pages: the first, the last and the 6 best middle ones of 32 (8 x 16)
        ({"context_tokens": 512, "variant": "paged_eviction_block@0.25"},
         "as paged_eviction_block@0.25 keeps 128 tokens (whole pages), not a multiple of "
         "LMCache's chunk_size 256"),
    ],
)  # fmt: skip
async def test_a_store_whose_kept_count_is_not_whole_chunks_is_a_400(
    upstream: tuple[Upstream, str], tmp_path: Path, store: dict[str, Any], match: str
) -> None:
    """Chunk-rounding methods keep whole chunks by construction (docs/integration.md: M is
    ``ratio * N`` to the nearest whole chunk); a page method's count is whole pages, refused
    before vLLM prefills unless they make whole chunks."""
    up, url = upstream
    config = RouterConfig(url, str(tmp_path / "no-daemon.sock"), chunk_tokens=256)
    router: TestClient[Any, Any] = TestClient(TestServer(make_app(config)))
    await router.start_server()
    try:
        body = {"model": "m", "prompt": _prompt(600), "kvtierd": store}
        r = await router.post("/v1/completions", json=body)
        assert r.status == 400
        assert match in (await r.json())["error"]["message"]
        assert up.bodies == []
    finally:
        await router.close()


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"{not json", "JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"model": "m"}', "prompt"),
        (b'{"model": "m", "prompt": "w1", "kvtierd": {"scope": "a/b"}}', "kvtierd.scope"),
        (b'{"model": "m", "prompt": "w1", "cache_salt": 7}', "cache_salt must be a non-empty"),
        (b'{"model": "m", "prompt": "w1", "cache_salt": ""}', "cache_salt must be a non-empty"),
    ],
)
async def test_a_malformed_request_is_a_400(
    upstream: tuple[Upstream, str], tmp_path: Path, data: bytes, match: str
) -> None:
    up, url = upstream
    router = await _router(url, str(tmp_path / "no-daemon.sock"))
    try:
        r = await router.post("/v1/completions", data=data)
        assert r.status == 400
        assert match in (await r.json())["error"]["message"]
        assert up.bodies == []
    finally:
        await router.close()


async def test_an_unreachable_vllm_is_a_502(tmp_path: Path) -> None:
    async with TestServer(web.Application()) as gone:
        url = str(gone.make_url("")).rstrip("/")
    router = await _router(url, str(tmp_path / "no-daemon.sock"))
    try:
        r = await router.post("/v1/completions", json={"model": "m", "prompt": "w1 w2"})
        assert r.status == 502
        assert "vLLM" in (await r.json())["error"]["message"]
    finally:
        await router.close()


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_lookup_timeout_that_is_not_positive_is_a_usage_error(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvtierd.integrations.router import main

    with pytest.raises(SystemExit) as e:
        main(["--upstream", "http://127.0.0.1:1", "--lookup-timeout-s", value])
    assert e.value.code == 2
    assert f"--lookup-timeout-s must be > 0, got {float(value)}" in capsys.readouterr().err


async def test_a_client_closing_after_done_is_no_error(
    upstream: tuple[Upstream, str], tmp_path: Path
) -> None:
    """Clients close a stream as soon as they read ``data: [DONE]``, often before its end: the
    router (the ``kvtierd router`` process, as deployed) logged a ``ClientConnectionResetError``
    traceback for each. A client going away is expected: no error, no traceback."""
    up, url = upstream
    log, port_file = tmp_path / "router.log", tmp_path / "router.port"
    with log.open("wb") as out:
        router = subprocess.Popen(
            [sys.executable, "-m", "kvtierd.main", "router", "--upstream", url, "--port", "0",
             "--port-file", str(port_file), "--socket", str(tmp_path / "no-daemon.sock")],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        port = await _bound_port(router, port_file, log)
        assert f"kvtierd router: listening on http://127.0.0.1:{port}" in log.read_text()
        body = json.dumps({"model": "m", "prompt": _prompt(4), "stream": True}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: "
                f"{len(body)}\r\nContent-Type: application/json\r\n\r\n").encode()  # fmt: skip
        for attempt in range(200):
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                break
            except OSError:
                assert attempt < 199 and router.poll() is None, log.read_text()
                await asyncio.sleep(0.1)
        served = 0
        for _ in range(5):
            up.finish.clear()
            writer.write(head + body)
            seen = b""
            while b"[DONE]" not in seen:
                chunk = await reader.read(4096)
                assert chunk, seen
                seen += chunk
            served += 1
            writer.transport.abort()  # closed at once, the stream's end unread (RST)
            await asyncio.sleep(0.2)
            up.finish.set()  # vLLM ends the stream after the client went away
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()
        await asyncio.sleep(1.0)
        assert served == 5 and router.poll() is None
    finally:
        router.terminate()
        router.wait(30)
    text = log.read_text()
    assert text.count('"POST /v1/completions HTTP/1.1" 200') == 5, text
    assert "Traceback" not in text and "Error handling request" not in text, text


async def _bound_port(router: subprocess.Popen[bytes], port_file: Path, log: Path) -> int:
    """The port a router started with ``--port 0`` bound, from its ``--port-file``."""
    for _ in range(300):
        if port_file.exists():
            return int(port_file.read_text())
        assert router.poll() is None, log.read_text()
        await asyncio.sleep(0.1)
    raise AssertionError(f"no {port_file} after 30 s; log:\n{log.read_text()}")


def test_a_taken_port_is_refused_with_its_number(tmp_path: Path) -> None:
    """``--port N`` where N is taken: one line naming the address, exit status 1."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "kvtierd.main", "router", "--upstream", "http://127.0.0.1:1",
             "--port", str(port), "--socket", str(tmp_path / "no-daemon.sock")],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert f"kvtierd router: cannot listen on 127.0.0.1:{port}" in done.stderr
