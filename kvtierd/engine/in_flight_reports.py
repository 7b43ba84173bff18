"""vLLM's requests in flight, as the routers in front of it report them
(``KVStore.ReportInFlight``).

EvicPress profiles with free cycles (§4.3). The daemon sees its own reads (``ReadPath.busy``),
but not vLLM prefilling a miss or decoding: only the router, which sends every request to vLLM
and sees its end, knows when vLLM is idle. Each router reports its count of real-traffic
requests on every change; the daemon's background profiling runs only while every count is 0.

Reports are client input: kept per (tenant, reporter), so that a client can only overwrite its
own; bounded (:data:`MAX_REPORTERS_PER_TENANT`, the oldest replaced); and a nonzero count lapses
after :data:`HOLD_S` unless reported again (a router that died with requests in flight, or a
client that reports a count and goes, cannot stop profiling for good). vLLM is shared, so any
tenant's requests in flight hold every tenant's profiling back: a report delays profiles, it
cannot move a context.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from collections.abc import Callable

from kvtierd.errors import InvalidArgumentError

HOLD_S = 30.0
"""How long a nonzero count holds without a new report (a router re-reports within it)."""
MAX_IN_FLIGHT = 1_000_000
MAX_REPORTERS_PER_TENANT = 8
REPORTER = re.compile(r"[A-Za-z0-9._-]{1,64}")


class InFlightReports:
    """The newest count of each (tenant, reporter); ``clock`` is monotonic seconds."""

    def __init__(
        self, *, hold_s: float = HOLD_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.hold_s = hold_s
        self.clock = clock
        self._counts: dict[str, OrderedDict[str, tuple[int, float]]] = {}
        self.reports = 0

    def report(self, tenant: str, reporter: str, in_flight: int) -> None:
        """``reporter`` of ``tenant`` has ``in_flight`` requests in flight now."""
        if not REPORTER.fullmatch(reporter):
            raise InvalidArgumentError(
                f"reporter must be 1 to 64 characters of A-Z, a-z, 0-9, '.', '_' or '-', got "
                f"{reporter[:80]!r}"
            )
        if not 0 <= in_flight <= MAX_IN_FLIGHT:
            raise InvalidArgumentError(
                f"in_flight must be between 0 and {MAX_IN_FLIGHT}, got {in_flight}"
            )
        counts = self._counts.setdefault(tenant, OrderedDict())
        counts[reporter] = (in_flight, self.clock())
        counts.move_to_end(reporter)
        while len(counts) > MAX_REPORTERS_PER_TENANT:
            counts.popitem(last=False)
        self.reports += 1

    def in_flight(self) -> int:
        """Requests in flight by every reporter whose count has not lapsed."""
        now = self.clock()
        return sum(n for counts in self._counts.values() for n, at in counts.values()
                   if now - at < self.hold_s)  # fmt: skip

    @property
    def busy(self) -> bool:
        return self.in_flight() > 0
