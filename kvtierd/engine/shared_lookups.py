"""What a lookup asks the shared tiers (a Redis Cluster other daemons store into too), with a
circuit breaker so that a tier that is down or hung never stalls a lookup (issue 40.6).

* A tier that is **down** (its health marked unhealthy: a failed call, or the background
  probe's PING unanswered) is not asked: a missed key is a miss, and an object the index says
  it holds counts as not found (a lookup must not promise what the next Get cannot deliver).
  The tier's own probe (``RemoteTier._probe_loop``, every ``health_interval_s``) closes the
  breaker again once every node answers.
* A tier that is **up** is asked about missed keys for at most its ``lookup_budget_s`` per
  lookup (default 50 ms). A question still unanswered then is left to finish in the
  background (its answer indexes the object for the next lookup, its failure marks the tier
  down) and the lookup answers without it; while such a question is overdue the breaker is
  open too, so a hung tier costs at most one budget, and holds at most one lookup's questions.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from kvtierd.engine.state import ObjectRecord
from kvtierd.storage import Tier

logger = logging.getLogger(__name__)

Fetch = Callable[[Tier, str, str], Coroutine[Any, Any, ObjectRecord | None]]


class SharedLookups:
    """The shared tiers' side of a lookup (module docstring); runs on the event loop."""

    def __init__(self, tiers: Sequence[Tier], fetch: Fetch) -> None:
        self._tiers = list(tiers)
        self._fetch = fetch  # asks one tier about one key, and indexes what it finds
        self._overdue: Counter[str] = Counter()  # per tier: questions past their budget
        self._background: set[asyncio.Task[ObjectRecord | None]] = set()
        self.skipped = 0  # lookups that did not ask a tier because its breaker was open

    def usable(self, tier: Tier) -> bool:
        """The breaker is closed: the tier is healthy and no question to it is overdue."""
        return tier.healthy and not self._overdue[tier.name]

    def unusable_names(self) -> set[str]:
        return {t.name for t in self._tiers if not self.usable(t)}

    def forget_unusable(self, found: list[ObjectRecord | None]) -> None:
        """An object held by a tier whose breaker is open counts as not found, unasked."""
        down = self.unusable_names()
        if not down:
            return
        for i, rec in enumerate(found):
            if rec is not None and rec.tier in down:
                found[i] = None

    async def fetch_missing(
        self, keys: Sequence[str], found: list[ObjectRecord | None], tenant: str
    ) -> None:
        """Fill ``found``'s gaps from the usable shared tiers, within their lookup budget."""
        missing = [i for i, f in enumerate(found) if f is None]
        tiers = [t for t in self._tiers if self.usable(t)]
        if len(tiers) < len(self._tiers):
            self.skipped += 1
        for tier in tiers:
            if not missing:
                return
            tasks = {i: asyncio.create_task(self._fetch(tier, keys[i], tenant)) for i in missing}
            await asyncio.wait(tasks.values(), timeout=tier.lookup_budget_s)
            for i, task in tasks.items():
                if not task.done():
                    self._overdue_in_background(tier, task)
                elif not task.cancelled() and task.exception() is None:
                    found[i] = task.result()
            missing = [i for i in missing if found[i] is None]

    def _overdue_in_background(self, tier: Tier, task: asyncio.Task[ObjectRecord | None]) -> None:
        if not self._overdue[tier.name]:
            logger.warning(
                "shared tier %s: no answer within its lookup budget of %.3g s; lookups skip it "
                "until its questions are answered or time out",
                tier.name, tier.lookup_budget_s,
            )  # fmt: skip
        self._overdue[tier.name] += 1
        self._background.add(task)

        def done(t: asyncio.Task[ObjectRecord | None]) -> None:
            self._background.discard(t)
            self._overdue[tier.name] -= 1
            if not t.cancelled():
                t.exception()  # retrieved: a failure already marked the tier down

        task.add_done_callback(done)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.wait(list(self._background))
