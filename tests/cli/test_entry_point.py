"""The installed ``kvtierctl`` binary: unreachable daemon, usage errors, a real run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks._support.daemon_proc import DaemonProcess

KVTIERCTL = str(Path(sys.executable).with_name("kvtierctl"))


def ctl(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [KVTIERCTL, *argv],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_unreachable_daemon_is_one_line_naming_the_socket(tmp_path: Path) -> None:
    sock = tmp_path / "none.sock"
    r = ctl("status", "--socket", str(sock))
    assert r.returncode == 3
    assert r.stdout == ""
    assert r.stderr.count("\n") == 1
    assert f"unix:{sock}" in r.stderr
    assert "./scripts/serve" in r.stderr and "kvtierd serve --config FILE" in r.stderr
    assert "Traceback" not in r.stderr


def test_socket_from_the_environment_and_a_dead_socket(tmp_path: Path) -> None:
    sock = tmp_path / "dead.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(sock))  # bound, never listening: a daemon that crashed
    try:
        r = ctl("contexts", "ls", env={"KVTIERD_SOCKET": str(sock)})
    finally:
        s.close()
    assert r.returncode == 3, r.stderr
    assert f"unix:{sock}" in r.stderr and "Traceback" not in r.stderr


def test_usage_errors_exit_2() -> None:
    assert ctl("frobnicate").returncode == 2
    assert ctl("contexts", "ls", "--sort", "colour").returncode == 2
    assert ctl("kv-size", "Llama-3.1-8B").returncode == 2  # --tokens is required


def test_help_lists_every_command() -> None:
    r = ctl("--help")
    assert r.returncode == 0
    for command in ("status", "tiers", "contexts", "evict", "pin", "unpin", "drain",
                    "rebalance", "policy", "kv-size", "exit codes"):  # fmt: skip
        assert command in r.stdout


def test_binary_against_a_daemon(start_daemon: Callable[..., DaemonProcess]) -> None:
    d = start_daemon()
    r = ctl("--json", "status", env={"KVTIERD_SOCKET": d.socket_path})
    assert r.returncode == 0, r.stderr
    assert '"health": "SERVING"' in r.stdout
    r = ctl("tiers", "--socket", d.socket_path)
    assert r.returncode == 0 and "cpu" in r.stdout and "ssd" in r.stdout
    d.stop()
    r = ctl("status", "--socket", d.socket_path)
    assert r.returncode == 3 and "Traceback" not in r.stderr
