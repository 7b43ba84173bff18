"""The router's in-flight reporter (``router/in_flight.py``) never holds up the router."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvtierd.integrations.router import in_flight
from kvtierd.integrations.router.in_flight import InFlightReporter


class _Stuck:
    """A daemon client whose report never answers, even when cancelled (a gRPC call whose
    completion is never delivered)."""

    def __init__(self) -> None:
        self.calls = 0
        self.never = asyncio.Event()

    async def report_in_flight(self, reporter: str, count: int) -> float:
        self.calls += 1
        while not self.never.is_set():
            try:
                await self.never.wait()
            except asyncio.CancelledError:
                continue  # swallowed, as a stuck call does
        return 30.0


async def test_close_is_bounded_while_a_report_is_stuck(monkeypatch: Any) -> None:
    monkeypatch.setattr(in_flight, "CLOSE_WAIT_S", 0.2)
    client = _Stuck()
    reporter = InFlightReporter(lambda: client)  # type: ignore[arg-type, return-value]
    with reporter.request():
        await asyncio.sleep(0.05)
    assert client.calls == 1 and reporter.count == 0
    started = time.monotonic()
    await asyncio.wait_for(reporter.close(), 10)
    assert time.monotonic() - started < 5
    client.never.set()  # lets the stuck task end before the loop closes


async def test_close_right_after_a_request_ends_the_task() -> None:
    """The request's end sets the reporter's event just before the router stops: the task's
    cancellation arrives while its wait is done. Python 3.11's ``asyncio.wait_for`` swallowed
    it, the task waited forever, and so did the router's shutdown (CI hung 300 s in two
    router tests)."""

    class _Quick:
        async def report_in_flight(self, reporter: str, count: int) -> float:
            return 30.0

    reporter = InFlightReporter(_Quick)  # type: ignore[arg-type]
    with reporter.request():
        await asyncio.sleep(0.05)
    await reporter.close()
    assert reporter._task is not None and reporter._task.done()


async def test_an_unexpected_error_in_a_report_does_not_end_the_reporter(
    monkeypatch: Any,
) -> None:
    """A report that fails with something else than the daemon's errors or a timeout (a bug,
    a bad answer) is retried like any failed report; before, it ended the task for good and
    the daemon never heard of the router's requests again."""
    monkeypatch.setattr(in_flight, "RETRY_S", 0.01)

    class _Flaky:
        def __init__(self) -> None:
            self.calls: list[int] = []

        async def report_in_flight(self, reporter: str, count: int) -> float:
            self.calls.append(count)
            if len(self.calls) == 1:
                raise RuntimeError("a bug in the client")
            return 30.0

    client = _Flaky()
    reporter = InFlightReporter(lambda: client)  # type: ignore[arg-type, return-value]
    with reporter.request():
        for _ in range(200):
            if reporter.reported == 1:
                break
            await asyncio.sleep(0.01)
    assert reporter._task is not None and not reporter._task.done()
    assert reporter.reported == 1 and reporter.failures == 0
    assert client.calls[:2] == [1, 1]  # the failed report, then the retry
    await reporter.close()
