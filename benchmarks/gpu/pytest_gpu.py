"""The ``pytest-gpu`` step's pieces: which files hold the gpu tests, how pytest runs them on
the device machine, and its results read back as checks (from the junit file, or from the
``-v`` lines of a run killed before pytest wrote it)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

from benchmarks.gpu.record import FAIL, PASS, SKIP, Check

# Every file holding a ``gpu``-marked test (tests/storage's come from conftest's TIER_MARKS on
# each test taking ``kind``); tests/test_gpu_check.py holds this list to a collection of tests/.
GPU_TEST_FILES = (
    "tests/kernels/test_kernels_gpu.py",
    "tests/daemon/test_device_leases.py",
    "tests/storage/test_tier_matrix.py",
    "tests/storage/test_uncalibrated.py",
    "tests/storage/test_pool_compaction.py",
)
PYTEST_ARGS = (
    # The image's own pytest plugins (cov, xdist, benchmark, ...) are not loaded: they were
    # built against its pytest, and the run uses the wheelhouse's.
    "-p",
    "pytest_asyncio.plugin",
    "-p",
    "pytest_timeout",
    "-p",
    "no:cacheprovider",
    "-m",
    "gpu",
    "-q",
    "-rfEs",
    "--timeout",
    "150",
)


def collected_count(output: str) -> int:
    """The number of tests ``pytest --collect-only`` selected, from any of its verbosities:
    ``N/M tests collected``, ``file.py: N`` lines (``-qq``) or ``file.py::test`` lines."""
    for line in output.splitlines():
        words = line.split()
        if "collected" in words and words[0].split("/")[0].isdigit():
            return int(words[0].split("/")[0])
    per_file = re.findall(r"^\S+\.py: (\d+)$", output, flags=re.MULTILINE)
    if per_file:
        return sum(int(n) for n in per_file)
    return sum("::" in line for line in output.splitlines())


def verbose_checks(output: str) -> list[Check]:
    """Checks from ``pytest -v`` lines (``tests/x.py::test_y[a] PASSED  [ 3%]``)."""
    status = {"PASSED": PASS, "FAILED": FAIL, "ERROR": FAIL, "SKIPPED": SKIP}
    checks = []
    for line in output.splitlines():
        words = line.split()
        if len(words) >= 2 and "::" in words[0] and words[1] in status:
            checks.append(Check(words[0], status[words[1]], words[1].lower(), "from the -v log"))
    return checks


def junit_checks(path: Path) -> list[Check]:
    if not path.exists():
        return []
    checks = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        seconds = float(case.get("time", 0))
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            checks.append(Check(name, FAIL, "failed", (bad.get("message") or "")[:400], seconds))
        elif (skip := case.find("skipped")) is not None:
            checks.append(Check(name, SKIP, "skipped", (skip.get("message") or "")[:200], seconds))
        else:
            checks.append(Check(name, PASS, "passed", "", seconds))
    return checks
