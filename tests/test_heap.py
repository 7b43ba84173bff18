"""kvtierd.heap: the heap a burst freed goes back to the system (issue 42's memory goal)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtierd.heap import _glibc

# In a child, with the daemon's malloc settings: 256 MiB in 64 KiB blocks (malloc's, not
# pymalloc's), all freed but the last (so the free memory is inside the heap, below a used
# block: free() alone hands none of it back), then trim(); prints RssAnon before and after.
_PROBE = """
import re
from pathlib import Path
from kvtierd.heap import trim, tune_malloc

def rss():
    return int(re.search(r"RssAnon:\\s+(\\d+) kB", Path("/proc/self/status").read_text())[1]) << 10

tune_malloc()
blocks = [bytearray(64 << 10) for _ in range(4096)]
last = blocks[-1]
del blocks
before = rss()
released = trim("the probe")
print(before, rss(), released)
"""


@pytest.mark.skipif(_glibc() is None, reason="malloc_trim is glibc's")
def test_trim_hands_back_freed_heap() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    before, after, released = out.stdout.split()
    assert released == "True"
    assert int(before) - int(after) > 200 << 20, out.stdout  # of the 256 MiB freed
