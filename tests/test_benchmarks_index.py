"""The commands that benchmarks/RESULTS.md's current-figures table and benchmarks/README.md name
exist (issue 38): each module answers ``--help``, each script is there, each section link
points at a heading. A benchmark moved or renamed without its row fails here, not in the hands
of the next person who copies the command."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "RESULTS.md"
README = REPO / "benchmarks" / "README.md"
TABLE_HEADING = "## Current figures"
COLUMNS = ("benchmark", "value", "interval", "date", "CPU", "commit", "command", "section")
# `kvtierd <subcommand>` is the console script of kvtierd.main.
CONSOLE_SCRIPTS = {"kvtierd": "kvtierd.main"}
BACKTICKED = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\]\(([^)]+)\)")


@dataclass(frozen=True, slots=True)
class Command:
    """What a command names: a module run with ``-m`` (and the subcommand words before its
    first option), or a script path."""

    module: str = ""
    words: tuple[str, ...] = ()
    script: str = ""


def table_rows(text: str) -> list[list[str]]:
    """The cells of the table under ``## Current figures`` (header and rule left out)."""
    after = text.split(TABLE_HEADING + "\n", 1)[1]
    rows = []
    for line in after.strip("\n").splitlines():
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        rows.append(cells)
    header, rule, *body = rows
    assert tuple(header) == COLUMNS and set("".join(rule)) <= {"-"}
    return body


def parse_command(text: str) -> Command | None:
    """The module or script a command line names; None for prose (e.g. a Python call)."""
    tokens = text.split()
    if len(tokens) >= 3 and tokens[0].endswith("python") and tokens[1] == "-m":
        return Command(module=tokens[2])
    if tokens and tokens[0] in CONSOLE_SCRIPTS:
        words = tuple(t for t in tokens[1:3] if not t.startswith("-"))
        return Command(module=CONSOLE_SCRIPTS[tokens[0]], words=words)
    if tokens and tokens[0].startswith("scripts/"):
        return Command(script=tokens[0])
    return None


def results_commands() -> set[Command]:
    found = set()
    for cells in table_rows(RESULTS.read_text()):
        for snippet in BACKTICKED.findall(cells[COLUMNS.index("command")]):
            command = parse_command(snippet)
            if command is not None:
                found.add(command)
    return found


def readme_commands() -> set[Command]:
    """The indented commands at the top of the README, and every module of its tables."""
    text = README.read_text()
    found = set()
    for line in text.splitlines():
        if line.startswith("    ") and (command := parse_command(line.strip())):
            found.add(command)
        if line.startswith("| `benchmarks."):
            found.add(Command(module=BACKTICKED.findall(line)[0]))
    return found


def module_file(module: str) -> Path:
    base = REPO.joinpath(*module.split("."))
    return base / "__main__.py" if base.is_dir() else base.with_suffix(".py")


def help_of(command: Command) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", command.module, *command.words, "--help"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip


def runnable(module: str) -> bool:
    """A module with a command line (helpers such as ``placer_daemon`` have none)."""
    path = module_file(module)
    return path.name == "__main__.py" or '__name__ == "__main__"' in path.read_text()


def test_the_table_opens_results_and_names_commands() -> None:
    text = RESULTS.read_text()
    assert text.index(TABLE_HEADING) < text.index("\n### ")  # the table before any section
    modules = {c.module for c in results_commands()}
    assert "benchmarks.e2e.e2e_matrix" in modules
    assert "benchmarks.e2e.bench_scale" in modules  # issue 42's figures at scale
    assert len(modules) >= 15
    assert len(text.splitlines()) < 600


def test_the_readme_opens_with_the_headline_command() -> None:
    first = README.read_text().splitlines()[0].strip()
    assert parse_command(first) == Command(module="benchmarks.e2e.e2e_matrix")
    assert "--lean" in first and "--runs" in first


def test_every_named_module_and_script_exists() -> None:
    commands = results_commands() | readme_commands()
    missing = [c.script for c in commands if c.script and not (REPO / c.script).is_file()]
    missing += [c.module for c in commands if c.module and not module_file(c.module).is_file()]
    assert missing == []


def test_every_section_link_of_the_table_finds_its_heading() -> None:
    broken = []
    for cells in table_rows(RESULTS.read_text()):
        for target in LINK.findall(cells[COLUMNS.index("section")]):
            path, _, anchor = target.partition("#")
            doc = (RESULTS.parent / path) if path else RESULTS
            if not finds(doc, anchor):
                broken.append(target)
    assert broken == []


def finds(doc: Path, anchor: str) -> bool:
    """Whether ``doc`` exists and, when an anchor is given, has a heading with that anchor."""
    if not doc.resolve().is_file():
        return False
    heads = [line for line in doc.read_text().splitlines() if line.startswith("#")]
    return not anchor or anchor in {github_anchor(h) for h in heads}


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_a_missing_module_fails_the_check() -> None:
    gone = Command(module="benchmarks.e2e.no_such_benchmark")
    assert not module_file(gone.module).is_file()
    assert help_of(gone).returncode != 0


@pytest.mark.slow
def test_every_named_command_answers_help() -> None:
    commands = sorted(
        (c for c in results_commands() | readme_commands() if c.module and runnable(c.module)),
        key=lambda c: (c.module, c.words),
    )
    failed = []
    for command in commands:
        done = help_of(command)
        if done.returncode != 0 or "usage" not in done.stdout:
            failed.append(f"{command.module} {' '.join(command.words)}: {done.stderr[-300:]}")
    assert failed == []
