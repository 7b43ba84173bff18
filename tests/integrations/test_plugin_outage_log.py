"""The plugin's outage as vLLM's log shows it (issue 41): in a process that configured no
logging for ``kvtierd`` (``vllm serve``: vLLM and LMCache configure only their own loggers),
the outage's WARNING, each dropped store's "N chunks NOT stored" INFO line and the outage's
end at INFO with its length and the stores dropped during it. Before, only the WARNING
appeared: Python's last-resort handler prints WARNING and up. A real daemon, started late."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks._support.daemon_proc import REPO, DaemonProcess

pytest.importorskip("lmcache")


def test_outage_end_and_dropped_stores_reach_the_log(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    sock = tmp_path / "d" / "kvtierd.sock"  # where start_daemon puts daemon "d"
    log = tmp_path / "plugin.log"
    with log.open("wb") as out:
        plugin = subprocess.Popen(
            [sys.executable, "-m", "tests.integrations.plugin_outage_run", str(sock)],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while "PUTS DONE" not in log.read_text():
            assert plugin.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        start_daemon(cpu="8MiB")
        assert plugin.wait(240) == 0, log.read_text()
    finally:
        plugin.kill()
    text = log.read_text()
    assert text.count("does not answer") == 1, text
    assert "INFO" in text and "3 chunks NOT stored: kvtierd is unreachable" in text, text
    assert "2 chunks NOT stored: kvtierd is unreachable" in text, text
    end = re.search(r"INFO .*answers again after an outage of ([0-9.]+) s; caching again "
                    r"\(5 chunks of 2 puts were NOT stored during it\)", text)  # fmt: skip
    assert end is not None, text
    assert float(end[1]) > 0
    assert "Traceback" not in text
