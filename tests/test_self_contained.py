"""A clone anywhere runs: no code under kvtierd/, benchmarks/, tests/ or scripts/ reads a folder
outside the repository (issue 25: the Azure trace was read from ``../shared``, so a fresh clone
failed ``tests/model/test_sim_e2e.py``). Data the code needs is kept in the repository, with its
attribution (``benchmarks/data/README.md``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.e2e import e2e_workload

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("kvtierd", "benchmarks", "tests", "scripts")
# Markdown is prose (RESULTS.md quotes the commands of past runs as they were typed); the data
# files are not code. Everything else (Python, shell, YAML, ...) counts.
NOT_CODE = {".md", ".csv", ".npz", ".png", ".svg", ".pdf", ".pyc", ".so"}
# The parent's shared folder spelt as a path ("../shared") or built in Python
# (``parents[2] / "shared"``, ``"shared" / "data"``).
OUTSIDE = re.compile(r'\.\./shared\b|/\s*"shared"|"shared"\s*/')


def code_files() -> list[Path]:
    out = []
    for top in CODE_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and path.suffix not in NOT_CODE and "__pycache__" not in path.parts:
                out.append(path)
    # This file names the patterns it looks for.
    out.remove(Path(__file__).resolve())
    return out


def outside_references(paths: list[Path], root: Path = ROOT) -> list[str]:
    found = []
    for path in paths:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return found


def test_no_code_refers_to_a_folder_outside_the_repository() -> None:
    files = code_files()
    assert len(files) > 100  # the walk found the code
    assert outside_references(files) == []


@pytest.mark.parametrize(
    "line",
    [
        'TRACE = Path(__file__).parents[2] / "shared" / "data" / "x.csv"',
        "cat ../shared/data/x.csv",
        "notes in ../shared/notes",
    ],
)
def test_the_check_sees_a_reference_outside(tmp_path: Path, line: str) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n" + line + "\n")
    assert outside_references([bad], root=tmp_path) == [f"bad.py:2: {line}"]


def test_the_azure_trace_is_read_from_the_repository() -> None:
    trace = e2e_workload.TRACE
    assert trace.is_relative_to(ROOT)
    assert trace.is_file()
    gaps = e2e_workload.trace_gaps()
    assert len(gaps) == 19_365  # 19,366 requests (the header is not one)
    assert all(g >= 0 for g in gaps)
    notice = (trace.parent / "README.md").read_text()
    for needed in ("CC-BY 4.0", "b469a113", "Splitwise", "Patel"):
        assert needed in notice
