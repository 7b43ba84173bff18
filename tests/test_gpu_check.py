"""scripts/gpu-check where CI runs: no CUDA, no package registry.

The wheelhouse here is a fake one (a minimal valid wheel per pinned distribution, built in
the test's tmp dir): ``--prepare`` needs the registry, which CI may not reach, and the real
wheels are for CPython 3.12 while CI runs 3.11 — what the run checks of them (manifest,
sha256, one fitting wheel per pin, ``pip install`` for the target platform) is the same for
fake ones. The run's imports are this environment's own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from benchmarks.gpu import wheelhouse
from benchmarks.gpu.pytest_gpu import GPU_TEST_FILES, collected_count, verbose_checks
from benchmarks.gpu.run import GPU_STEPS, Runner

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu-check"


def fake_wheel(folder: Path, name: str, version: str, tag: str = "py3-none-any") -> Path:
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-{tag}.whl"
    info = f"{dist}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": (
            f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n"
        ),
    }
    record = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for f, text in {**files, f"{info}/RECORD": record}.items():
            z.writestr(f, text)
    return path


def fake_house(folder: Path, skip: str = "") -> Path:
    folder.mkdir(parents=True)
    for name, version in wheelhouse.WHEELS.items():
        if name != skip:
            fake_wheel(folder, name, version)
    wheelhouse.write_manifest(folder)
    return folder


def run_script(*args: str, **kw: object) -> subprocess.Popen[str]:
    env = os.environ | {"PYTHONPATH": str(REPO), "GPU_CHECK_PYTHON": sys.executable}
    env.pop("OUT", None)
    return subprocess.Popen(
        [str(SCRIPT), *args], cwd=REPO, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw,  # type: ignore[call-overload]
    )  # fmt: skip


@pytest.fixture
def no_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the no-CUDA path; this machine has CUDA")


def test_no_cuda_run_checks_it_would_run_and_skips_each_gpu_step(tmp_path: Path, no_cuda):
    house = fake_house(tmp_path / "wheels")
    proc = run_script("--wheelhouse", str(house), "--out", str(tmp_path / "out"))
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output
    doc = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert doc["mode"] == "no-cuda" and doc["finished"] is True
    steps = {s["name"]: s for s in doc["steps"]}
    assert list(steps) == ["env", "wheelhouse", "imports", *(s.name for s in GPU_STEPS)]
    for name in ("env", "wheelhouse", "imports"):
        assert steps[name]["status"] == "PASS", steps[name]
    for gpu in GPU_STEPS:
        assert steps[gpu.name]["status"] == "SKIP" and "no CUDA" in steps[gpu.name]["reason"]
    assert steps["pytest-gpu"]["figure"].split()[0].isdigit()
    assert int(steps["pytest-gpu"]["figure"].split()[0]) > 0
    install = steps["wheelhouse"]["checks"][1]
    assert install["name"] == "pip install --no-index" and install["status"] == "PASS"
    md = (tmp_path / "out" / "gpu-check.md").read_text()
    assert all(f"| {name} | " in md for name in steps)


def test_an_incomplete_wheelhouse_fails_the_run_naming_the_missing_wheel(tmp_path, no_cuda):
    house = fake_house(tmp_path / "wheels", skip="highspy")
    args = ("--wheelhouse", str(house), "--out", str(tmp_path / "out"), "--only", "kernels")
    proc = run_script(*args)
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 1, output
    doc = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    step = next(s for s in doc["steps"] if s["name"] == "wheelhouse")
    assert step["status"] == "FAIL"
    assert "highspy==1.16.0 needed, wheelhouse has none" in step["checks"][0]["reason"]


def test_verify_names_each_problem(tmp_path: Path) -> None:
    house = fake_house(tmp_path / "wheels")
    assert wheelhouse.verify(house) == []
    redis = next(house.glob("redis-*.whl"))
    redis.write_bytes(redis.read_bytes() + b"x")
    fake_wheel(house, "torch", "2.11.0", "cp312-cp312-macosx_11_0_arm64")
    problems = wheelhouse.verify(house)
    assert f"{redis.name} does not match its sha256 in the manifest" in problems
    assert "torch-2.11.0-cp312-cp312-macosx_11_0_arm64.whl is in" in problems[-1]
    wheelhouse.write_manifest(house)
    problems = wheelhouse.verify(house)
    assert any("does not install on CPython 3.12" in p for p in problems)
    assert any("torch must come from the image" in p for p in problems)
    assert wheelhouse.verify(tmp_path / "absent")[0].startswith("no manifest.json")


def test_the_carry_limit_is_checked(tmp_path: Path) -> None:
    house = fake_house(tmp_path / "wheels")
    assert wheelhouse.check_size(house)[0] == wheelhouse.folder_bytes(house)
    with open(house / "big.bin", "wb") as f:  # sparse: its size counts, no disk is used
        f.truncate(wheelhouse.LIMIT_BYTES)
    with pytest.raises(RuntimeError, match="the device tool would refuse to send it"):
        wheelhouse.check_size(house)


def test_a_step_past_its_timeout_is_killed_with_its_children(tmp_path: Path) -> None:
    runner = Runner(tmp_path / "out", tmp_path, budget_s=60, quick=True)
    child = tmp_path / "child.pid"
    code = (
        "import subprocess, pathlib, time; p = subprocess.Popen(['sleep', '60']); "
        f"pathlib.Path({str(child)!r}).write_text(str(p.pid)); time.sleep(60)"
    )
    t0 = time.monotonic()
    rc, timed_out, _ = runner.spawn([sys.executable, "-c", code], 3, dict(os.environ))
    assert timed_out and rc is None and time.monotonic() - t0 < 20
    stat = Path(f"/proc/{int(child.read_text())}/stat")
    time.sleep(0.2)
    # The grandchild went with its group: gone, or a zombie waiting for init to reap it.
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_sigterm_leaves_the_report_of_what_ran(tmp_path: Path, no_cuda) -> None:
    house = fake_house(tmp_path / "wheels")
    out = tmp_path / "out"
    proc = run_script("--wheelhouse", str(house), "--out", str(out), "--only", "kernels")
    deadline = time.monotonic() + 120
    while not (out / "gpu-check.json").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    doc = json.loads((out / "gpu-check.json").read_text())
    assert doc["finished"] is False and doc["stopped"] == "stopped by SIGTERM", output
    assert doc["steps"][0]["name"] == "env" and doc["steps"][-1]["status"] == "FAIL"


def test_gpu_test_files_hold_every_gpu_marked_test() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p",
         "no:cacheprovider", "tests"],
        cwd=REPO, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    files = {line.split("::")[0] for line in done.stdout.splitlines() if "::" in line}
    assert files == set(GPU_TEST_FILES), done.stdout[-2000:]


def test_pytest_lines_become_checks_when_junit_is_missing() -> None:
    out = (
        "tests/a.py::test_x[gpu-1] PASSED   [ 50%]\n"
        "tests/a.py::test_y FAILED   [100%]\n"
        "tests/b.py::test_z SKIPPED (needs CUDA) [100%]\n"
        "32/73 tests collected (41 deselected) in 0.60s\n"
    )
    checks = verbose_checks(out)
    assert [(c.name, c.status) for c in checks] == [
        ("tests/a.py::test_x[gpu-1]", "PASS"),
        ("tests/a.py::test_y", "FAIL"),
        ("tests/b.py::test_z", "SKIP"),
    ]
    assert collected_count(out) == 32


def test_every_step_is_documented() -> None:
    doc = (REPO / "docs" / "gpu-check.md").read_text()
    for name in ("env", "wheelhouse", "imports", *(s.name for s in GPU_STEPS)):
        assert f"| `{name}` |" in doc, name
    assert 'carry=[".gpu-wheels"]' in doc


def test_collected_counts_read_from_every_verbosity() -> None:
    assert collected_count("tests/a.py: 21\ntests/b.py: 1\n") == 22
    assert collected_count("tests/a.py::x\ntests/a.py::y\n\n") == 2
    assert collected_count("no tests ran\n") == 0
