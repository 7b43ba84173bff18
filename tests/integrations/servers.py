"""``vllm serve`` (+ LMCache + plugin) and ``kvtierd router`` as subprocesses for the tests."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.integrations.harness import REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{url}: process exited; log:\n{log.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} not up in {timeout_s}s; log:\n{log.read_text()[-6000:]}")


def start_vllm(
    work: Path, model: Path, lmcache: dict[str, Any]
) -> tuple[subprocess.Popen[bytes], str]:
    cfg = work / "lmcache-serve.yaml"
    cfg.write_text(yaml.safe_dump(lmcache))
    port = free_port()
    kv = {"kv_connector": "KvtierLMCacheConnectorV1", "kv_role": "kv_both",
          "kv_connector_module_path": "kvtierd.integrations.cpu_connector"}  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "LMCACHE_TRACK_USAGE": "false",
           "LMCACHE_CONFIG_FILE": str(cfg)}  # fmt: skip
    log = work / "vllm-serve.log"
    # ``vllm serve`` itself looks up the ``vllm`` distribution, which the CPU build names
    # ``vllm-cpu``; the API server module is the same server.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--port", str(port),
           "--load-format", "safetensors", "--dtype", "bfloat16", "--enforce-eager",
           "--max-model-len", "2048", "--max-num-seqs", "4", "--seed", "0",
           "--kv-transfer-config", json.dumps(kv)]  # fmt: skip
    return _spawn(cmd, env, log, port, 240)


def start_router(
    work: Path, upstream: str, sock: str, chunk: int
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    log = work / "router.log"
    code = "import sys; from kvtierd.integrations.router import main; sys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", code, "--upstream", upstream, "--socket", sock,
           "--port", str(port), "--chunk-size", str(chunk)]  # fmt: skip
    return _spawn(cmd, {**os.environ, "PYTHONPATH": str(REPO)}, log, port, 60)


def _spawn(
    cmd: list[str], env: dict[str, str], log: Path, port: int, timeout_s: float
) -> tuple[subprocess.Popen[bytes], str]:
    """``cmd`` in the repository with its output in ``log``, once its ``/health`` answers."""
    proc = subprocess.Popen(
        cmd,
        stdout=open(log, "wb"),  # noqa: SIM115 - the child keeps the file
        stderr=subprocess.STDOUT,
        env=env,
        cwd=REPO,
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", proc, log, timeout_s)
    return proc, url


def post(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read()), dict(r.headers)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def post_stream(url: str, body: dict[str, Any]) -> tuple[list[Any], dict[str, str]]:
    """A streamed request: its ``data:`` events in order (``"[DONE]"`` as that string, the
    others parsed) and the response headers."""
    req = urllib.request.Request(
        url, json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"}
    )
    events: list[Any] = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: "):
                payload = line.removeprefix("data: ")
                events.append(payload if payload == "[DONE]" else json.loads(payload))
        return events, dict(r.headers)


def get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=30) as r:
        result: dict[str, Any] = json.loads(r.read())
        return result


@contextlib.contextmanager
def router_stack(work: Path, model: Path) -> Iterator[dict[str, Any]]:
    """A daemon (LRU test config), ``vllm serve`` with the kvtierd LMCache plugin, and
    ``kvtierd router`` in front of it; torn down in reverse order."""
    from tests.daemon_proc import DaemonProcess, write_config
    from tests.integrations.harness import CHUNK, lmcache_config

    config = write_config(work / "daemon")
    sock = str(work / "daemon" / "kvtierd.sock")
    daemon = DaemonProcess(config, sock, work / "daemon" / "daemon.log").start()
    procs = []
    try:
        vllm, vurl = start_vllm(work, model, lmcache_config(sock))
        procs.append(vllm)
        router, rurl = start_router(work, vurl, sock, CHUNK)
        procs.append(router)
        yield {"router": rurl, "vllm": vurl, "socket": sock, "model": str(model),
               "vllm_log": work / "vllm-serve.log"}  # fmt: skip
    finally:
        for p in reversed(procs):
            stop(p)
        daemon.kill()
