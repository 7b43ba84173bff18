"""The router's real-traffic requests in flight at vLLM, reported to the daemon (issue 26).

The daemon profiles in the background only while vLLM is idle (EvicPress §4.3), and only the
router sees every request go to vLLM and end. So the router counts them — from the moment it
has read a request to the end of its answer (a stream: its last event), not a profiler's
scoped requests (``kvtierd.router_protocol``) — and reports the count (``KVStore.ReportInFlight``)
on every change, and again while it stays above 0 (the daemon lets a nonzero count lapse after
the ``hold_s`` it answers, in case the router dies with requests in flight).

One report at a time, always the newest count, so reports never arrive out of order; a burst of
changes costs one report. Best effort, like the router's other reports: a daemon that is down
or slow costs only the signal (logged once per outage), never a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Iterator

from kvtierd.client import AsyncKVClient
from kvtierd.errors import KvtierError

logger = logging.getLogger(__name__)

REPORT_TIMEOUT_S = 5.0
RETRY_S = 1.0  # after a failed report
DEFAULT_HOLD_S = 30.0  # until the daemon says
CLOSE_WAIT_S = 1.0  # for a report in flight when the router stops


class InFlightReporter:
    """Counts requests (:meth:`request`) and reports the count through ``client()``."""

    def __init__(self, client: Callable[[], AsyncKVClient]) -> None:
        self._client = client
        self.reporter = f"router-{uuid.uuid4().hex[:12]}"
        self.count = 0
        self.reported = 0  # the count the daemon has
        self.failures = 0
        self._hold_s = DEFAULT_HOLD_S
        self._changed: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """One real-traffic request, from now to the end of the block."""
        self._move(+1)
        try:
            yield
        finally:
            self._move(-1)

    def _move(self, step: int) -> None:
        self.count += step
        if self._changed is None:  # made inside the server's loop, at its first request
            self._changed = asyncio.Event()
            self._task = asyncio.ensure_future(self._report_forever(self._changed))
        self._changed.set()

    async def _report_forever(self, changed: asyncio.Event) -> None:
        while True:
            # a nonzero count is renewed before it lapses at the daemon
            renew = self._hold_s / 3 if self.reported else None
            # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancellation
            # that arrives as the event is set, and the router's shutdown then waited forever
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(renew):
                    await changed.wait()
            changed.clear()
            if not await self._report(self.count):
                await asyncio.sleep(RETRY_S)
                changed.set()

    async def _report(self, count: int) -> bool:
        try:
            async with asyncio.timeout(REPORT_TIMEOUT_S):
                hold_s = await self._client().report_in_flight(self.reporter, count)
            self._hold_s = hold_s or DEFAULT_HOLD_S
        except Exception as e:  # any failure: the task lives on (retries)
            # not only KvtierError and timeouts: a bug or a bad answer ended the task for
            # good before, and the daemon then never heard of requests in flight again
            if not self.failures:
                unexpected = not isinstance(e, KvtierError | TimeoutError)
                logger.warning("requests in flight not reported to kvtierd (%s); its "
                               "background profiling judges idleness by its own reads "
                               "meanwhile", e, exc_info=unexpected)  # fmt: skip
            self.failures += 1
            return False
        if self.failures:
            logger.info("requests in flight reported to kvtierd again")
        self.failures = 0
        self.reported = count
        return True

    async def close(self) -> None:
        """Stops reporting. Bounded: a report stuck in gRPC does not hold up the router's
        shutdown (the daemon lets the count lapse after ``hold_s``)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=CLOSE_WAIT_S)
