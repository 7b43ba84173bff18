"""kvtierctl fixtures: run the CLI against a real daemon (``start_daemon`` in tests/conftest.py).

Commands run in-process through ``kvtierd.cli.main.main`` (the daemon is a real subprocess on a
real socket); ``test_entry_point.py`` runs the installed ``kvtierctl`` binary itself.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from benchmarks._support.daemon_proc import DaemonProcess
from kvtierd.cli.main import main
from kvtierd.client import KVClient
from tests.cli_result import Result

Ctl = Callable[..., Result]


@pytest.fixture
def ctl(capsys: pytest.CaptureFixture[str]) -> Callable[[DaemonProcess | None], Ctl]:
    """``ctl(daemon)("contexts", "ls", "--json")`` -> Result (exit code, stdout, stderr)."""

    def bind(daemon: DaemonProcess | None) -> Ctl:
        def run(*argv: str) -> Result:
            capsys.readouterr()
            socket = ["--socket", daemon.socket_path] if daemon else []
            code = main([*argv, *socket])
            captured = capsys.readouterr()
            return Result(code, captured.out, captured.err)

        return run

    return bind


def put_contexts(daemon: DaemonProcess, sizes: dict[str, int]) -> None:
    """Store one object per context (``<context>/0``) of the given byte size, in order."""
    with KVClient(daemon.socket_path) as c:
        for cid, size in sizes.items():
            c.put(f"{cid}/0", np.full(size, 7, dtype=np.uint8), context_id=cid)
