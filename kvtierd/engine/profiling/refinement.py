"""Which context the policy's refining evaluator profiles next (issue 26, item 4; EvicPress
§4.3: re-profiling with free cycles).

Every context has the cheap estimator's profile from its first put. The refining evaluator
(``answer``, ``served``: one to several prefills a context) is spent only where it can change
a decision: a context whose placer margin (``margin.py``) is within the estimator's error
(``profiling.estimator_error``), with enough queries for a trusted profile
(``profiling.min_queries``), and not tried on the queries it has now (a refinement is tried
again once real traffic or a user brings new ones: the drift check of a refined context).
The most frequently read first: its decision is worth the most. The caller runs it only while
vLLM is idle (``ProfilingService``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvtierd.engine.context_options import ContextOptions
from kvtierd.engine.index import ContextIndex
from kvtierd.engine.state import ContextRecord, RunningPolicy

if TYPE_CHECKING:
    from kvtierd.profiler import Profiler


def _no_margin(_: ContextRecord) -> float:
    return math.inf


class Refinement:
    """The candidates of the module docstring, over the contexts of ``index``.
    ``margin_of(ctx)`` is the placer's margin on a context (``margin.py``); the engine, which
    wires the placer, passes it (without it nothing is refined)."""

    def __init__(
        self,
        *,
        index: ContextIndex,
        options: ContextOptions,
        policy: RunningPolicy,
        profiler: Callable[[], Profiler | None],
        margin_of: Callable[[ContextRecord], float] = _no_margin,
    ) -> None:
        self._index = index
        self._options = options
        self._policy = policy
        self._profiler = profiler
        self.margin_of = margin_of
        self._tried: dict[str, int] = {}  # context -> its queries' version when last tried

    def next(self) -> ContextRecord | None:
        """The context to refine now, or ``None``."""
        p = self._profiler()
        if p is None or p.refiner is None:
            return None
        error = self._policy.current.estimator_error
        candidates = [c for c in self._index.contexts.values() if self._open(p, c)]
        candidates.sort(key=lambda c: self._options.frequency(c.context_id) or 0.0, reverse=True)
        return next((c for c in candidates if self.margin_of(c) <= error), None)

    def _open(self, p: Profiler, ctx: ContextRecord) -> bool:
        cid = ctx.context_id
        return (
            not ctx.durable_held
            and p.record(cid) is not None  # its first profile is the estimator's
            and self._tried.get(cid) != p.queries.version(cid)
            and p.enough_queries(cid)
            and not self._options.unchoosable(ctx)
        )

    def tried(self, context_id: str) -> None:
        """A refinement of the context starts, on the queries it has now."""
        p = self._profiler()
        if p is not None:
            self._tried[context_id] = p.queries.version(context_id)

    def forget(self, context_id: str) -> None:
        self._tried.pop(context_id, None)
