"""The run's record: one :class:`StepResult` per step, written as ``gpu-check.json`` and
``gpu-check.md`` after every step (and when the run is stopped), so a run cut short still
leaves what it found."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.gpu.record import FAIL, PASS, SKIP, Check


@dataclass
class StepResult:
    name: str
    goal: str
    status: str = SKIP  # PASS | FAIL | SKIP
    seconds: float = 0.0
    figure: str = ""
    reason: str = ""
    checks: list[Check] = field(default_factory=list)

    def settle(self, rc: int | None, timed_out: bool, timeout_s: float) -> None:
        """Status from the process's end and its checks: a timeout or a non-zero exit fails
        the step even where every check it finished passed."""
        failed = [c for c in self.checks if c.status == FAIL]
        passed = [c for c in self.checks if c.status == PASS]
        self.figure = self.figure or f"{len(passed)} of {len(self.checks)} checks passed"
        if timed_out:
            self.status = FAIL
            self.reason = f"killed at its {timeout_s:.0f} s timeout (checks so far kept)"
        elif rc:
            self.status = FAIL
            self.reason = self.reason or f"exited {rc} (see gpu-check.log)"
        elif failed:
            self.status = FAIL
            self.reason = "failed: " + ", ".join(c.name for c in failed[:8])
        elif not self.checks:
            self.status = FAIL
            self.reason = self.reason or "reported no checks"
        else:
            self.status = PASS


@dataclass
class Report:
    out: Path
    mode: str = "unknown"
    started: float = field(default_factory=time.time)
    env: dict[str, object] = field(default_factory=dict)
    steps: list[StepResult] = field(default_factory=list)
    finished: bool = False
    stopped: str = ""

    def exit_code(self) -> int:
        return 1 if any(s.status == FAIL for s in self.steps) else 0

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        doc = {
            "tool": "scripts/gpu-check",
            "mode": self.mode,
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
            "elapsed_s": round(time.time() - self.started, 1),
            "finished": self.finished,
            "stopped": self.stopped,
            "env": self.env,
            "steps": [asdict(s) for s in self.steps],
        }
        _replace(self.out / "gpu-check.json", json.dumps(doc, indent=1, default=str) + "\n")
        _replace(self.out / "gpu-check.md", self.markdown(doc))

    def markdown(self, doc: dict[str, object]) -> str:
        versions = self.env.get("versions", {})
        lines = [
            "# scripts/gpu-check",
            "",
            f"Started {doc['started_utc']}, {doc['elapsed_s']} s, mode {self.mode}, "
            f"{'finished' if self.finished else 'NOT finished ' + self.stopped}.",
            f"Device: {self.env.get('device', 'none')} ({self.env.get('sms', '?')} SMs, "
            f"{self.env.get('memory_gib', '?')} GiB); python {self.env.get('python', '?')}; "
            f"versions {json.dumps(versions)}",
            "",
            "| step | status | s | figure | reason | goal |",
            "|---|---|---|---|---|---|",
        ]
        for s in self.steps:
            lines.append(
                f"| {s.name} | {s.status} | {s.seconds:.1f} | {_cell(s.figure)} | "
                f"{_cell(s.reason)} | {_cell(s.goal)} |"
            )
        lines += _throughput_table(self.env.get("throughput"))
        for s in self.steps:
            if not s.checks:
                continue
            lines += [
                "",
                f"## {s.name}",
                "",
                "| check | status | s | figure | reason |",
                "|---|---|---|---|---|",
            ]
            lines += [
                f"| {_cell(c.name)} | {c.status} | {c.seconds:.2f} | {_cell(c.figure)} | "
                f"{_cell(c.reason)} |"
                for c in s.checks
            ]
        return "\n".join(lines) + "\n"


def _throughput_table(figures: object) -> list[str]:
    """The throughput step's rows as RESULTS.md holds kernel timings."""
    if not isinstance(figures, dict) or not figures.get("rows"):
        return []
    copy = float(figures.get("copy_bytes_per_s", 0))
    out = [
        "",
        f"Device-to-device copy (read + write): {copy / 1e9:.0f} GB/s.",
        "",
        "| kernel | N | ms | GB/s | x copy | bytes counted |",
        "|---|---|---|---|---|---|",
    ]
    for r in figures["rows"]:
        flops = float(r.get("flops_per_s", 0))
        counts = _cell(str(r.get("counts", "")))
        out.append(
            f"| {r['kernel']} | {r['tokens']} | {r['time_s'] * 1e3:.3f} | "
            f"{r['bytes_per_s'] / 1e9:.0f} | {r['vs_copy']:.0%} | {counts}"
            + (f"; {flops / 1e12:.1f} TFLOP/s |" if flops else " |")
        )
    return out


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


__all__ = ["FAIL", "PASS", "SKIP", "Report", "StepResult"]
