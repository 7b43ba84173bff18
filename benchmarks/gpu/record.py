"""What a step process reports: named checks, each PASS or FAIL with its figure, written to a
JSON file after every check so a step killed at its timeout still leaves what it found."""

from __future__ import annotations

import argparse
import json
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: str  # PASS | FAIL | SKIP
    figure: str  # the measured number(s), e.g. "max |err| 3.1e-06 (tol 1e-05)"
    reason: str = ""  # why it failed or was skipped; what the figure is held to
    seconds: float = 0.0


@dataclass
class Recorder:
    """Collects a step's checks and rewrites ``path`` after each one."""

    path: Path
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, object] = field(default_factory=dict)

    def add(self, check: Check) -> None:
        self.checks.append(check)
        mark = {PASS: "ok  ", FAIL: "FAIL", SKIP: "skip"}[check.status]
        print(f"  {mark} {check.name}: {check.figure} {check.reason}".rstrip(), flush=True)
        self.flush()

    def run(self, name: str, fn: Callable[[], tuple[bool, str, str]]) -> None:
        """Run one check: ``fn`` returns ``(passed, figure, reason)``; an exception fails it
        with its message (the step goes on with its next check)."""
        t0 = time.perf_counter()
        try:
            ok, figure, reason = fn()
            status = PASS if ok else FAIL
        except Exception as e:
            status, figure = FAIL, "raised"
            reason = f"{type(e).__name__}: {e}"[:600]
            traceback.print_exc()
        self.add(Check(name, status, figure, reason, round(time.perf_counter() - t0, 3)))

    def flush(self) -> None:
        doc = {"checks": [asdict(c) for c in self.checks], "figures": self.figures}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        tmp.replace(self.path)


def step_args(description: str) -> argparse.Namespace:
    """Every step module takes ``--result FILE`` (where its checks go) and ``--quick`` (the
    test sizes only: for trying the harness under ``TRITON_INTERPRET=1`` on a CPU)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--result", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    return ap.parse_args()


def load_checks(path: Path) -> tuple[list[Check], dict[str, object]]:
    if not path.exists():
        return [], {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return [], {}
    return [Check(**c) for c in doc.get("checks", [])], dict(doc.get("figures", {}))
