"""Keeps ``grpc.health.v1`` in step with the daemon's real state.

The daemon is ``SERVING`` while the plan executor runs and every tier reports healthy;
otherwise ``NOT_SERVING`` with a description of what is wrong (``Admin.Status.health``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from grpc_health.v1 import health, health_pb2

from kvtierd.engine import Engine

logger = logging.getLogger(__name__)

SERVICES = ("", "kvtierd.v1.KVStore", "kvtierd.v1.Admin")


class HealthMonitor:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.servicer = health.aio.HealthServicer()
        self._task: asyncio.Task[None] | None = None
        self._last = ""

    def problems(self) -> list[str]:
        return self.engine.problems()

    def describe(self) -> str:
        return "; ".join(self.problems()) or "SERVING"

    async def update(self) -> None:
        self.engine.publish_tier_state()
        state = self.describe()
        self.engine.metrics.set_healthy(state == "SERVING")
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if state == "SERVING"
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        if state != self._last:
            # Draining is a stop someone asked for: an ERROR would page an operator for it.
            if self.problems() == ["draining"]:
                logger.info("daemon not serving: draining (stopping)")
            elif state != "SERVING":
                logger.error("daemon unhealthy: %s", state)
            self._last = state
        for name in SERVICES:
            await self.servicer.set(name, status)

    def start(self, period_s: float = 1.0) -> None:
        async def loop() -> None:
            while True:
                await self.update()
                await asyncio.sleep(period_s)

        self._task = asyncio.create_task(loop(), name="kvtierd-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for name in SERVICES:
            await self.servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
