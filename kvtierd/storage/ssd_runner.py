"""Runs the SSD tier's blocking calls on its own I/O threads, and its operations as tasks.

Kept apart from the tier so the tier reads as storage logic. Two rules live here:
an operation, once started, runs to its end even if its caller is cancelled (a thread cannot
be stopped mid-``pwritev``, and a half-cleaned-up put would leak its temp file); and a batch of
calls on one fd is always waited for as a whole before anyone may close that fd.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvtierd.errors import UnavailableError

T = TypeVar("T")


class IoRunner:
    """``threads`` I/O threads (= the disk queue depth of one tier) and the tier's tasks."""

    def __init__(self, name: str, threads: int) -> None:
        self.name = name
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False

    def start(self) -> None:
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix=f"ssd-{self.name}")

    async def close(self) -> None:
        """Refuse new operations, wait for in-flight ones, stop the threads."""
        self._closing = True
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if self._pool is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown)
            self._pool = None

    async def spawn(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run an operation as a tracked task that the caller's cancellation cannot interrupt."""
        if self._closing or self._pool is None:
            coro.close()
            raise UnavailableError(f"tier {self.name} is not started or is closing")
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # no "never retrieved"
        return await asyncio.shield(task)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on an I/O thread."""
        return await self.submit(_Once(fn, args))

    def submit(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        if self._pool is None:
            raise UnavailableError(f"tier {self.name} is not started or is closed")
        return asyncio.get_running_loop().run_in_executor(self._pool, _Once(fn, ()))

    async def run_all(
        self, calls: list[Callable[[], Any]], each: Callable[[int, Any], None] | None = None
    ) -> list[Any]:
        """Run calls on the I/O threads; ``each(i, result)`` sees results in call order as they
        arrive (to overlap hashing with the I/O still in flight). Always waits for *all* calls
        — a failed part must not let us close the fd under a still-running one — and raises
        the first error in call order."""
        futs = [self.submit(c) for c in calls]
        try:
            results = []
            for i, fut in enumerate(futs):
                results.append(await fut)
                if each is not None:
                    each(i, results[-1])
            return results
        finally:
            await asyncio.gather(*futs, return_exceptions=True)


class _Once:
    """A call that drops its arguments as soon as it returns.

    The executor's work item outlives the call by a moment (it is deleted only after the
    result has been handed to the event loop); if it still held a slice of the caller's
    buffer, a caller that closes its mmap right after ``read_into`` returns would get
    ``BufferError: cannot close exported pointers exist``.
    """

    __slots__ = ("_args", "_fn")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self._fn: Callable[..., Any] | None = fn
        self._args = args

    def __call__(self) -> Any:
        fn, args = self._fn, self._args
        self._fn, self._args = None, ()
        if fn is None:
            raise RuntimeError("a _Once call runs once")
        return fn(*args)
