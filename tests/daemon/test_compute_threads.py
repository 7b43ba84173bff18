"""The daemon's own torch compute (profiling on the real model, compression) leaves cores to
vLLM: ``compute_threads`` threads, else the operator's ``OMP_NUM_THREADS``, else half the CPU
cores. On the 2-core machine a profile on both cores beside vLLM's two OpenMP threads made the
end-to-end run's hits take 6-10 s instead of 0.7 s."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvtierd.config import load_daemon_config, validate
from kvtierd.errors import ConfigError
from kvtierd.server.main import limit_compute_threads
from tests.daemon.test_profiling_engine import _config

SET_THEN_IMPORT = (
    "import os, sys\n"
    "from kvtierd.server.main import limit_compute_threads\n"
    "assert 'torch' not in sys.modules\n"
    "n = limit_compute_threads(int(sys.argv[1]))\n"
    "import torch\n"
    "print(n, torch.get_num_threads())\n"
)


def _threads_in_fresh_process(requested: int, omp: str | None) -> tuple[int, int]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    command = [sys.executable, "-c", SET_THEN_IMPORT, str(requested)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True, timeout=120)
    out = done.stdout
    chosen, torch_threads = out.split()
    return int(chosen), int(torch_threads)


def test_torch_in_the_daemon_uses_the_threads_chosen_before_it_was_imported() -> None:
    half = max(1, len(os.sched_getaffinity(0)) // 2)
    assert _threads_in_fresh_process(0, None) == (half, half)  # the default: half the cores
    assert _threads_in_fresh_process(0, "2") == (2, 2)  # the operator's OMP_NUM_THREADS
    assert _threads_in_fresh_process(1, "2") == (1, 1)  # compute_threads wins over it


def test_once_torch_is_imported_it_is_told_directly(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", str(before))  # the fixture puts both back
    monkeypatch.setenv("MKL_NUM_THREADS", str(before))
    try:
        assert limit_compute_threads(1) == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("value", [-1, 5000])
def test_compute_threads_is_validated(tmp_path: Path, value: int) -> None:
    allowed = r"compute_threads must be between 0 \(half the CPU cores\) and 1024"
    with pytest.raises(ConfigError, match=allowed):
        validate(replace(_config(tmp_path), compute_threads=value))


def test_compute_threads_is_read_from_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "kvtierd.yaml"
    path.write_text(
        f"socket_path: {tmp_path / 's'}\ndata_dir: {tmp_path / 'd'}\ncompute_threads: 2\n"
        "tiers:\n  - {name: cpu, kind: cpu, capacity: 64MiB}\n"
    )
    assert load_daemon_config(str(path)).compute_threads == 2
    path.write_text(path.read_text().replace("compute_threads: 2", "compute_threads: two"))
    with pytest.raises(ConfigError, match="expected int, got 'two'"):
        load_daemon_config(str(path))


def test_numpy_huge_page_advice_is_off_unless_the_operator_chose() -> None:
    """numpy's huge-page advice made a 100k-context rebalance ~0.6 s slower (issue 28): the
    daemon turns it off, and leaves NUMPY_MADVISE_HUGEPAGE's choice alone."""
    probe = ("from kvtierd.server.main import tune_numpy\n"
             "from numpy._core import multiarray\n"
             "got = tune_numpy()\n"
             "print(got, multiarray._set_madvise_hugepage(got))\n")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                         check=True).stdout.split()  # fmt: skip
    assert out == ["False", "False"]
    chosen = subprocess.run([sys.executable, "-c", probe],
                            env={**env, "NUMPY_MADVISE_HUGEPAGE": "1"}, capture_output=True,
                            text=True, check=True).stdout.split()  # fmt: skip
    assert chosen == ["True", "True"]
