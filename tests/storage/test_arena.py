"""The arena: a memfd nothing can leak (even a SIGKILLed daemon), or a named file whose
leftovers from dead daemons are removed at start; the allocator coalesces and reports
fragmentation."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtierd.errors import CapacityError, InvalidArgumentError
from kvtierd.storage.allocator import FreeListAllocator
from kvtierd.storage.arena import Arena, remove_stale_arenas


def test_memfd_arena_is_shared_through_proc() -> None:
    arena = Arena(1 << 20)
    try:
        assert str(arena.path).startswith(f"/proc/{os.getpid()}/fd/")
        block = arena.allocate(4096)
        arena.view(block)[:5] = b"hello"
        fd = os.open(arena.path, os.O_RDONLY)  # what a client does
        try:
            assert os.pread(fd, 5, block.offset) == b"hello"
        finally:
            os.close(fd)
    finally:
        arena.close()


def test_named_arena_of_a_killed_daemon_is_removed(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import time
        from kvtierd.storage.arena import Arena
        a = Arena(1 << 20, {str(tmp_path)!r})
        print(a.path, flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    path = Path(proc.stdout.readline().strip())  # type: ignore[union-attr]
    assert path.exists()
    assert remove_stale_arenas(tmp_path) == 0  # its daemon is alive
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert path.exists()  # a SIGKILL leaves the file behind ...
    assert remove_stale_arenas(tmp_path) == 1  # ... and the next start removes it
    assert not path.exists()


def test_allocator_coalesces_and_reports_fragmentation() -> None:
    a = FreeListAllocator(16 * 4096)
    blocks = [a.allocate(4096) for _ in range(16)]
    with pytest.raises(CapacityError):
        a.allocate(1)
    for b in blocks[::2]:
        a.free(b)
    assert a.free_bytes == 8 * 4096 and a.largest_free_bytes == 4096
    assert a.fragmentation == pytest.approx(1 - 1 / 8)
    for b in blocks[1::2]:
        a.free(b)
    assert a.largest_free_bytes == 16 * 4096 and a.fragmentation == 0.0
    with pytest.raises(InvalidArgumentError, match="double free"):
        a.free(blocks[0])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40_000)), max_size=60))
def test_allocator_never_overlaps(ops: list[tuple[bool, int]]) -> None:
    a = FreeListAllocator(64 * 4096)
    live = []
    for free, size in ops:
        if free and live:
            a.free(live.pop(size % len(live)))
            continue
        try:
            live.append(a.allocate(size))
        except CapacityError:
            continue
        spans = sorted((b.offset, b.offset + b.padded) for b in live)
        assert all(x[1] <= y[0] for x, y in itertools.pairwise(spans))
        assert all(b.offset % 4096 == 0 and b.padded >= b.length for b in live)
    assert a.free_bytes == a.size_bytes - sum(b.padded for b in live)
