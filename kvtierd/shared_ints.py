"""One int object for each row number, shared by every table that stores it (issue 42).

An int above 256 is a 32-byte object of its own each time one is made. The engine's option
rows and the placer's slots each map every context id to a row number, a million of them at
issue 42's scale; numbered from 0 up, the two tables hold the same numbers, and through
:func:`shared_row` one object (and this pool's 8-byte pointer) for each instead of two.
The pool grows to the highest number asked for, a block at a time, never shrinks (rows are
reused: the highest number is the most rows a table has held at once) and is only read and
grown on the daemon's event loop (or one thread of a test)."""

from __future__ import annotations

_BLOCK = 4096
_POOL: list[int] = []


def shared_row(n: int) -> int:
    """``n`` (``>= 0``) as the pool's one object of that value."""
    if n >= len(_POOL):
        _POOL.extend(range(len(_POOL), n + _BLOCK))
    return _POOL[n]
