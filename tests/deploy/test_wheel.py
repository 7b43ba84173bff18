"""The installable wheel (issue 32, item 1): ``scripts/wheel-check`` builds the wheel and sdist,
installs the wheel into a clean virtualenv and runs ``kvtierd serve``, ``kvtierctl status``, a
put/get and the LMCache plugin's import from it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks._support.daemon_proc import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _build_python() -> str:
    """The interpreter that builds: KVTIERD_BUILD_PYTHON, else the project's (dev extra)."""
    python = os.environ.get("KVTIERD_BUILD_PYTHON") or sys.executable
    probe = [python, "-c", "import build, hatchling"]
    if subprocess.run(probe, capture_output=True, check=False).returncode != 0:
        pytest.skip(f"{python} lacks `build` and `hatchling` (the dev extra): run scripts/setup")
    return python


def test_wheel_installs_and_runs_from_a_clean_venv(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["KVTIERD_BUILD_PYTHON"] = _build_python()
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "wheel-check"), str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280, check=False,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "wheel-check: ok (kvtierd-" in output
    assert "put/get through the installed client: ok" in output
    assert "SERVING" in output
    installed = tmp_path / "venv"
    assert str(installed) in output  # the plugin was imported from the wheel, not the tree
    assert shutil.which("kvtierd", path=str(installed / "bin"))
