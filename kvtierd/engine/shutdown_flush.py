"""What a graceful stop keeps: the CPU tier's hottest contexts, written to the SSD tier.

The CPU tier is shared memory that dies with the daemon, so a rolling update of the sidecar
would otherwise empty the hottest part of the cache every time. On SIGTERM, after in-flight
calls finished, :func:`flush_cpu_tier` moves contexts from the CPU tier to the first SSD tier,
most recently used first, until ``shutdown_flush_s`` is spent or the SSD tier is full, each only
where its tenant's quota for the SSD tier has room (the flush moves bytes like any plan); the SSD
tier rebuilds its index from its files at the next start (``Engine._rebuild_index``).

Idle times survive the same way: :func:`save_access_times` writes every context's last access
as wall-clock time into the data directory, and :func:`restore_access_times` turns them back
into this process's monotonic clock. A context with no record (the daemon was killed) counts
as used at the restart: its true idle time is unknown, and the machine's uptime (what a zero
monotonic time would show) is certainly wrong.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvtierd.engine.down_batch import DownBatch, down_objects, down_target
from kvtierd.engine.index import ContextIndex
from kvtierd.engine.mover import TierMover
from kvtierd.engine.state import ContextRecord
from kvtierd.errors import KvtierError
from kvtierd.storage import Tier
from kvtierd.storage.ssd import SsdTier

logger = logging.getLogger(__name__)

ACCESS_TIMES_FILE = "last_access.json"


@dataclass(frozen=True, slots=True)
class FlushReport:
    """What a flush wrote: ``contexts`` of ``candidates`` (those in the CPU tier), their
    ``bytes_written``, in ``elapsed_s``; ``target`` is the SSD tier ("" when there is none)."""

    target: str
    candidates: int
    contexts: int
    bytes_written: int
    elapsed_s: float
    batches: int = 0  # writes of many small objects with one sync each (SsdTier.put_many)

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_written / self.elapsed_s if self.elapsed_s > 0 else 0.0


def _on_cpu(ctx: ContextRecord, index: ContextIndex, cpu: str) -> bool:
    return any(index.objects[k].tier == cpu for k in ctx.keys if k in index.objects)


async def flush_cpu_tier(
    index: ContextIndex, mover: TierMover, tiers: Mapping[str, Tier], bound_s: float
) -> FlushReport:
    """Move the CPU tier's contexts to the SSD tier, most recently used first, for at most
    ``bound_s`` seconds. A context is only started when the rate measured so far says it
    finishes in time (its first one always is), and only when the SSD tier has room for it
    within its tenant's quota there. Contexts of small objects are written in batches, with
    one filesystem sync per batch (``down_batch``), others one by one."""
    target = down_target(tiers)  # the tier a graceful stop writes to
    cpu = mover.cpu.name
    hot = sorted(
        (c for c in index.contexts.values() if _on_cpu(c, index, cpu)),
        key=lambda c: c.last_access_s,
        reverse=True,
    )
    flush = _Flush(index, mover, target, bound_s)
    if target is not None and bound_s > 0:
        for ctx in hot:
            if not await flush.offer(ctx):
                break
        await flush.write_batch()
    report = FlushReport(
        target.name if target else "",
        len(hot),
        flush.done,
        flush.written,
        time.perf_counter() - flush.started,
        flush.batch.batches if flush.batch is not None else 0,
    )
    _log(report, bound_s)
    return report


class _Flush:
    """One flush's progress: what is written, and the batch being filled."""

    def __init__(
        self, index: ContextIndex, mover: TierMover, target: SsdTier | None, bound_s: float
    ) -> None:
        self.index, self.mover, self.bound_s = index, mover, bound_s
        self.target = target
        self.started = time.perf_counter()
        self.written = self.done = 0
        self.batch = DownBatch[ContextRecord](index, mover, target) if target else None

    def _in_time(self, nbytes: int) -> bool:
        elapsed = time.perf_counter() - self.started
        rate = self.written / elapsed if self.written else 0.0
        return elapsed + (nbytes / rate if rate else 0.0) <= self.bound_s

    async def offer(self, ctx: ContextRecord) -> bool:
        """Write ``ctx`` (now, or in the batch); False once the time is spent."""
        assert self.target is not None
        target, batch = self.target, self.batch
        queued = batch.nbytes if batch else 0
        if not self._in_time(queued + ctx.size_bytes):
            return False
        if ctx.size_bytes > target.capacity_bytes - target.used_bytes() - queued:
            return True  # no room for this one; a smaller one may fit
        if self.index.quota_tier(ctx, target.name, [target.name]) is None:
            return True  # beyond its tenant's quota there (issue 40.7)
        objs = down_objects(self.index, ctx, self.mover.cpu.name, target.name)
        if batch is None or not objs:
            await self.write_batch()
            await self._move(ctx)
            return True
        batch.add(ctx, objs, ctx)
        if batch.full:
            await self.write_batch()
        return True

    async def _move(self, ctx: ContextRecord) -> None:
        assert self.target is not None
        try:
            self.written += await self.mover.move_context(ctx, self.target.name)
        except KvtierError as e:  # e.g. the SSD tier filled up under us: keep what is done
            logger.warning("shutdown flush: context %s not written: %s", ctx.context_id, e)
            return
        self.done += 1

    async def write_batch(self) -> None:
        """Write the batch with one sync; a context that changed since it joined is moved
        alone."""
        if not self.batch:
            return
        wrote = await self.batch.write()
        if wrote.error is not None:
            logger.warning("shutdown flush: a batch of %d contexts not written: %s",
                           len(wrote.failed), wrote.error)  # fmt: skip
        self.written += wrote.nbytes
        self.done += len(wrote.written)
        for ctx in wrote.changed:
            if self.index.contexts.get(ctx.context_id) is ctx:
                await self._move(ctx)


def _log(report: FlushReport, bound_s: float) -> None:
    if not report.target:
        if report.candidates:
            logger.warning("shutdown flush: no ssd tier; %d contexts of the cpu tier are lost",
                           report.candidates)  # fmt: skip
        return
    logger.info(
        "shutdown flush: wrote %d of %d cpu-tier contexts (%.1f MB) to %s in %.2f s "
        "(%.2f GB/s; %d batches; bound %.1f s)",
        report.contexts, report.candidates, report.bytes_written / 1e6, report.target,
        report.elapsed_s, report.bytes_per_s / 1e9, report.batches, bound_s,
    )  # fmt: skip


def save_access_times(index: ContextIndex, data_dir: str) -> None:
    """Each context's last access as wall-clock seconds, in ``data_dir``."""
    now_wall, now_mono = time.time(), time.monotonic()
    times = {
        c.context_id: now_wall - (now_mono - c.last_access_s)
        for c in index.contexts.values()
        if c.last_access_s > 0
    }
    path = Path(data_dir) / ACCESS_TIMES_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(times))
        os.replace(tmp, path)
    except OSError as e:  # idle times are a nicety; the stop goes on
        logger.warning("cannot save context access times to %s: %s", path, e)


def restore_access_times(index: ContextIndex, data_dir: str) -> int:
    """Give rebuilt contexts their saved last access (or the restart, when none was saved);
    returns how many had a saved one. The file is used once: removed after reading."""
    path = Path(data_dir) / ACCESS_TIMES_FILE
    saved: dict[str, float] = {}
    with contextlib.suppress(OSError, ValueError):
        loaded = json.loads(path.read_text())
        if isinstance(loaded, dict):
            saved = {str(k): float(v) for k, v in loaded.items()}
    with contextlib.suppress(OSError):
        path.unlink()
    now_wall, now_mono = time.time(), time.monotonic()
    found = 0
    for ctx in index.contexts.values():
        wall = saved.get(ctx.context_id)
        if wall is None:
            ctx.last_access_s = now_mono
            continue
        ctx.last_access_s = now_mono - max(0.0, now_wall - wall)
        found += 1
    return found
