"""Read-only views of the engine for the servicers: frozen values they translate to replies,
so a servicer reads what the engine shows and cannot change its records."""

from __future__ import annotations

from dataclasses import dataclass


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
