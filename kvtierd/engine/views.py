"""Read-only views of the engine for the servicers: frozen values they translate to replies,
so a servicer reads what the engine shows and cannot change its records."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtierd.engine.profiling.profile_runs import ProfileRun

if TYPE_CHECKING:
    from kvtierd.profiler import ProfileRecord


class LookupOutcome(enum.Enum):
    """What a served request's lookup found (``LookupRequest.request``): every chunk asked,
    its first chunks only (vLLM computes the rest), or nothing."""

    HIT = "hit"
    PARTIAL = "partial"
    MISS = "miss"

    @classmethod
    def of(cls, asked: int, prefix: int) -> LookupOutcome:
        if prefix <= 0:
            return cls.MISS
        return cls.HIT if prefix >= asked else cls.PARTIAL


@dataclass(frozen=True, slots=True)
class EngineCounts:
    """What ``Admin.Status`` reports of the engine."""

    instance_id: str
    uptime_s: float
    placer: str
    contexts: int
    objects: int
    leases: int
    allocations: int
    draining: bool
    hits: int
    misses: int
    pending_plans: int
    durable_holds: int
    lookups: Mapping[LookupOutcome, int] = field(default_factory=dict)  # served requests'


@dataclass(frozen=True, slots=True)
class ContextSummary:
    """One context as ``ListContexts`` shows it: where it is, how big, how used, protected."""

    context_id: str
    variant: str
    tier: str  # "" = nowhere (its objects are gone)
    size_bytes: int
    objects: int
    frequency: float
    last_access_s: float  # monotonic
    pinned: bool
    hits: int
    durable_unread: int
    durable_held: bool
    parent: str = ""  # the context this one continues ("" = a root; issue 29)
    children: int = 0
    token_drop_refused: str = ""  # why token-dropped variants are not offered ("" = they are)


@dataclass(frozen=True, slots=True)
class PrefillSpeed:
    """The TTFT model's prefill speed (learned from served requests, or configured), the
    samples served requests gave, and the fitted fixed cost per request (0 until learned)."""

    tokens_per_s: float
    samples: int
    overhead_s: float
    learned: bool


@dataclass(frozen=True, slots=True)
class ProfilingCounts:
    """What ``Admin.ProfileStatus`` reports of the daemon's profiling as a whole."""

    runs_ok: int
    runs_failed: int
    reprofiled: int
    last_error: str
    runs: tuple[ProfileRun, ...]  # the newest runs (profile_runs.py)


@dataclass(frozen=True, slots=True)
class ContextProfiling:
    """One context's profile as ``Admin.ProfileStatus`` shows it: what its next profile would
    run on (``(query source, queries, token ids known)``, None before the profiler is
    configured), its kept profile (None: not profiled) and whether the placer trusts it."""

    upcoming: tuple[str, int, int] | None
    record: ProfileRecord | None
    trusted: bool
