"""Background profiling yields to serving between steps, not only between contexts.

EvicPress profiles "only when idle" (§4.3: with free GPU cycles). The daemon's own check ran
once per context, but a context's profile on the real model is seconds of decoding (the
``answer`` evaluator: every variant, every query, ``max_new_tokens`` steps). On a host where
the daemon and vLLM share the cores, a profile that started in a quiet moment ran
on through the next requests: in the end-to-end run (RESULTS.md, issue 13) EvicPress's hits
took 0.6-0.9 s while the daemon profiled and compressed, and 0.25-0.3 s (as LRU's) once it had
stopped. So the evaluators call :meth:`YieldGate.wait` before each step (a decode step, a
layer), and the gate blocks while the engine says it is serving.

A gate never blocks forever: under traffic with no gap at all it lets one step through every
``max_wait_s``, so profiles still finish (slower) and a stale profile cannot outlive the load.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class YieldGate:
    """``wait()`` blocks while ``is_busy()``, polling every ``poll_s``, at most ``max_wait_s``."""

    def __init__(
        self,
        is_busy: Callable[[], bool],
        *,
        poll_s: float = 0.05,
        max_wait_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.is_busy = is_busy
        self.poll_s = poll_s
        self.max_wait_s = max_wait_s
        self.clock = clock
        self.sleep = sleep
        self.waits = 0  # steps that found the engine serving
        self.waited_s = 0.0  # seconds those steps waited
        self._lock = threading.Lock()

    def wait(self) -> float:
        """Seconds this step waited (0.0 when the engine was not serving)."""
        if not self.is_busy():
            return 0.0
        start = self.clock()
        while self.is_busy() and self.clock() - start < self.max_wait_s:
            self.sleep(self.poll_s)
        waited = self.clock() - start
        with self._lock:
            self.waits += 1
            self.waited_s += waited
        return waited
