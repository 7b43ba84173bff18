"""Per-context decisions that are routine at scale: one DEBUG line each, an INFO summary per
interval.

A daemon fed many small contexts makes the same decision for most of them (issue 42: one INFO
line per put, 50,000 lines for 50,000 contexts, which no one reads). :class:`DecisionLog`
logs each decision at DEBUG and counts it by reason; the counts go to INFO once per
``interval_s`` after the first decision of an interval, and at stop, then start again.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

logger = logging.getLogger(__name__)

SUMMARY_INTERVAL_S = 60.0


class DecisionLog:
    """Counts of one kind of decision (``what``: e.g. "contexts not profiled") per reason."""

    def __init__(self, what: str, interval_s: float = SUMMARY_INTERVAL_S) -> None:
        self.what = what
        self.interval_s = interval_s
        self.counts: Counter[str] = Counter()
        self._timer: asyncio.TimerHandle | None = None
        self._since = 0.0

    def note(self, context_id: str, reason: str, detail: str = "") -> None:
        """One context's decision: DEBUG now (with ``detail``), counted by ``reason`` in the
        next summary."""
        logger.debug("context %s: %s%s", context_id, reason, detail)
        self.counts[reason] += 1
        if self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a synchronous caller): summarized at stop
                return
            self._since = loop.time()
            self._timer = loop.call_later(self.interval_s, self.summarize)

    def summarize(self) -> None:
        """The counts since the last summary at INFO (nothing when there are none)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.counts:
            return
        total = sum(self.counts.values())
        reasons = "; ".join(f"{n} x {reason}" for reason, n in self.counts.most_common())
        logger.info("%s: %d in the last interval (per reason: %s)", self.what, total, reasons)
        self.counts.clear()
