"""Shared-memory arenas left by daemons that were SIGKILLed (the daemon does not remove them:
see test_arena_leak.py). The fault tests kill daemons on purpose, so they clean up after
themselves: only files whose daemon process is gone, so a live daemon is never touched."""

from __future__ import annotations

import time
from pathlib import Path

ARENA_DIR = Path("/dev/shm")


def arenas_of(pid: int) -> list[Path]:
    return sorted(ARENA_DIR.glob(f"kvtierd-{pid}-*.arena"))


def remove_dead_arenas(since_s: float) -> int:
    """Remove arenas created after ``since_s`` (epoch seconds) whose daemon has exited."""
    removed = 0
    for path in ARENA_DIR.glob("kvtierd-*-*.arena"):
        try:
            pid = int(path.name.split("-")[1])
            fresh = path.stat().st_mtime >= since_s
        except (ValueError, OSError):
            continue
        if fresh and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def now_s() -> float:
    return time.time() - 1.0  # mtime granularity
