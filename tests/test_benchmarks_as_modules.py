"""Benchmarks run as modules from the repository root (benchmarks/__init__.py): started as a
file, one stops at once with the command to use instead of importing another checkout's
``benchmarks`` or site-packages' ``tests``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_benchmark_started_as_a_file_names_the_module_command() -> None:
    env = os.environ | {"PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "benchmarks/micro/bench_placer.py", "--help"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert "python -m benchmarks.micro.bench_placer (not python " in done.stderr
    as_module = subprocess.run(
        [sys.executable, "-m", "benchmarks.micro.bench_placer", "--help"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert as_module.returncode == 0 and "usage" in as_module.stdout
