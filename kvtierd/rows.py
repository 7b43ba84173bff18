"""What the tables holding a row per context share: their row numbers, and how they grow.

The engine's option rows and the placer's slots each map every context id to a row of numpy
arrays, a million of them at issue 42's scale.

* **Row numbers.** An int above 256 is a 32-byte object of its own each time one is made.
  Both tables number their rows from 0 up, so they hold the same numbers: through
  :func:`shared_row` one object for each (and this pool's 8-byte pointer) instead of two. The
  pool grows to the highest number asked for, a block at a time, and never shrinks (rows are
  reused: the highest number is the most rows a table has held at once). It is read and grown
  on the daemon's event loop (or one thread of a test).
* **Growth.** A table full of rows grows by a quarter (:func:`grown_capacity`), not twice
  over: the rows not taken yet are written (zeros, or -1 for "none") and resident, ~100 bytes
  each in the slots and ~70 in the option rows, and doubling at 526,316 contexts (bench_scale's
  1M objects) left ~520,000 of them waiting, ~90 bytes an object.
"""

from __future__ import annotations

_BLOCK = 4096
_POOL: list[int] = []


def shared_row(n: int) -> int:
    """``n`` (``>= 0``) as the pool's one object of that value."""
    if n >= len(_POOL):
        _POOL.extend(range(len(_POOL), n + _BLOCK))
    return _POOL[n]


def grown_capacity(rows: int) -> int:
    """The rows a full table of ``rows`` grows to: a quarter more (at least 16)."""
    return max(16, rows + rows // 4)
