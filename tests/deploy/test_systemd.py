"""deploy/systemd (issue 32, item 5): the unit passes ``systemd-analyze verify``, its stop
timeout covers a graceful stop's flush, and its config puts the socket in its runtime dir."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks._support.daemon_proc import REPO
from kvtierd.config import load_daemon_config
from kvtierd.server.app import GRACE_S

UNIT = REPO / "deploy" / "systemd" / "kvtierd.service"
CONFIG = REPO / "deploy" / "systemd" / "kvtierd.yaml"
INSTALLED_AT = "/usr/local/bin/kvtierd"


def _unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(UNIT.read_text())
    return parser


def _verify(unit_text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze missing: apt-get install systemd (Debian's package)")
    # The unit names where the wheel installs the daemon; here the project's own entry point.
    here = Path(sys.executable).parent / "kvtierd"
    unit = tmp_path / "kvtierd.service"
    unit.write_text(unit_text.replace(INSTALLED_AT, str(here)))
    return subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip


def test_unit_verifies(tmp_path: Path) -> None:
    done = _verify(UNIT.read_text(), tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    """The check above can fail: a bad value and a misspelt key are reported (on stderr; the
    exit status stays 0 for both, which is why the test reads stderr)."""
    broken = (
        UNIT.read_text()
        .replace("Restart=on-failure", "Restart=sometimes")
        .replace("TimeoutStopSec=", "TimeoutStopSek=")
    )
    done = _verify(broken, tmp_path)
    assert "restart specifier" in done.stderr
    assert "Unknown key 'TimeoutStopSek'" in done.stderr


def test_unit_keeps_the_socket_and_state_where_the_config_says() -> None:
    service = _unit()["Service"]
    assert service["User"] == "kvtierd" and service["Restart"] == "on-failure"
    config = load_daemon_config(CONFIG)
    assert Path(config.socket_path).parent == Path("/run") / service["RuntimeDirectory"]
    assert Path(config.data_dir) == Path("/var/lib") / service["StateDirectory"]
    assert service["ExecStart"].split()[0] == INSTALLED_AT
    assert f"--config /etc/{service['ConfigurationDirectory']}/kvtierd.yaml" in service["ExecStart"]


def test_stop_timeout_covers_the_graceful_flush() -> None:
    config = load_daemon_config(CONFIG)
    stop_s = float(_unit()["Service"]["TimeoutStopSec"])
    assert stop_s >= GRACE_S + config.shutdown_flush_s + 10  # 10 s to close the tiers
