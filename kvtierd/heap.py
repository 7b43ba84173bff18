"""The daemon's memory housekeeping: the C heap under Python's (glibc's ``malloc`` tuned for
the daemon's large buffers, the memory a one-off burst freed handed back to the system; both
no-ops where the C library is not glibc: ``mallopt`` and ``malloc_trim`` are glibc's), and the
cyclic garbage collector paused over passes that make many long-lived objects.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
from collections.abc import Iterator

logger = logging.getLogger(__name__)


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def tune_malloc() -> None:
    """Keep large buffers in the heap instead of fresh mmaps: protobuf and gRPC allocate a
    new buffer per message, and page-faulting fresh 4 MiB mappings costs ~10x the copy
    (notes/machine-limits.md: 2.5 -> 14.6 GB/s for protobuf serialisation). The heap is then
    never trimmed by ``free``: :func:`trim` hands back what a one-off burst freed."""
    libc = _glibc()
    if libc is None:
        return
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)
    libc.mallopt(m_trim_threshold, 16 << 30)
    libc.mallopt(m_top_pad, 256 << 20)


def trim(why: str) -> bool:
    """Hand the heap's free pages back to the system (``malloc_trim(0)``: the free top and
    every free whole page inside); ``why`` is logged at DEBUG. For after a burst that does not
    recur, such as a restart's index rebuild: at 1,000,000 objects it leaves ~70-200 bytes an
    object of freed lists, dict tables and decoded columns, which the daemon's untrimmed heap
    (:func:`tune_malloc`) would otherwise keep resident for good. Whether anything was
    released."""
    libc = _glibc()
    if libc is None:
        return False
    released = bool(libc.malloc_trim(0))
    logger.debug("heap trimmed after %s: %s", why, "released" if released else "nothing free")
    return released


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block (as it was after): for a pass that
    allocates a few long-lived objects per context, where each full collection it would start
    walks every object the daemon holds (placing's rebalance, a restart's index)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
