"""Typed values shared by every layer: objects, variants, placements, plans, profiles.

Vocabulary (DESIGN.md §2): a *context* is a reusable token prefix and its KV cache; a *variant*
is a form of a context's KV (``none`` is the original); an *object* is a stored blob; a *tier*
is a storage level; a *placement* is ``(variant, tier)`` or dropped; a *plan* is an ordered list
of operations produced by a placer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

ORIGINAL_VARIANT = "none"
"""Name of the uncompressed variant of every context (ratio 1.0)."""


@dataclass(frozen=True, slots=True)
class ObjectMeta:
    """What the daemon knows about one stored object, independent of the tier holding it.

    ``layout`` is a free-form descriptor of the tensor layout (e.g. ``"KV_2LTD"``);
    ``kept_indices`` is an opaque little-endian int32 array (kept token positions of a
    compressed variant), empty for originals. ``checksum`` is xxh3_64 of the bytes (0 = not yet
    computed, e.g. while an object lives only in shared memory). ``durable``: committed durable
    (kept with its persistent copies, so that a restart still knows the placer may not drop
    it before it is read: docs/daemon.md).
    """

    key: str
    size_bytes: int
    context_id: str = ""
    variant: str = ORIGINAL_VARIANT
    dtype: str = "uint8"
    shape: tuple[int, ...] = ()
    layout: str = ""
    token_count: int = 0
    kept_indices: bytes = b""
    tenant: str = ""
    checksum: int = 0
    durable: bool = False
    # The context this object's context continues (a branch after a shared prefix, issue 29;
    # "" = a root). Kept with persistent copies, so that the tree survives a restart.
    parent_context_id: str = ""
    # The object's place in its context's order (issue 31): the index numbers a context's
    # chunks as they join it, kept with persistent copies so that a restart lists them in
    # put order (ssd_format.check_position_field). None: not numbered yet (a put not indexed
    # yet), or a copy written before positions were kept.
    position: int | None = None

    @property
    def context(self) -> str:
        """The context this object belongs to; an object without one is its own context."""
        return self.context_id or self.key


@dataclass(frozen=True, slots=True)
class TierStats:
    """A tier's state as reported to the engine, the placer and operators."""

    name: str
    capacity_bytes: int
    used_bytes: int
    object_count: int
    read_bandwidth_bytes_per_s: float
    write_bandwidth_bytes_per_s: float
    fragmentation: float = 0.0
    healthy: bool = True
    detail: str = ""


@dataclass(frozen=True, slots=True)
class TierModel:
    """What a placer needs to know about a tier (fastest tier first in every list).

    ``capacity_bytes`` of ``None`` means unbounded (EvicPress's remote bottom tier).
    """

    name: str
    capacity_bytes: int | None
    load_bandwidth_bytes_per_s: float
    load_overhead_s: float = 0.0


@dataclass(frozen=True, slots=True)
class VariantProfile:
    """One variant of one context: its size, its quality (1.0 = original) and restore cost."""

    variant: str
    size_bytes: int
    quality: float = 1.0
    restore_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ContextProfile:
    """Everything a placer needs about a context (EvicPress §4.1: quality, size, frequency).

    ``variants`` are the forms the placer may store the context as, never empty. Under an
    eviction-only policy that is the one form the context has. Otherwise the original comes
    first whenever it can be had (stored, or kept as a reference copy), then the policy's
    variants the context can be stored and served as. A context the daemon keeps only
    quantized (``int8``, no reference copy: ``self_sourced`` in ``engine/index.py``) has no
    original among them: its own form comes first, then the variants ``derivable`` from it;
    one kept only token-dropped has just its own form. (A profiler's record always lists
    ``none``: the KV it measured against, for a quantized-only context its dequantized form.)
    ``prefill_s`` is the time to recompute the context when dropped; ``last_access_s`` is a
    monotonic timestamp for recency-based placers.
    """

    context_id: str
    variants: tuple[VariantProfile, ...]
    frequency: float = 1.0
    prefill_s: float = 0.0
    last_access_s: float = 0.0
    pinned: bool = False

    def variant(self, name: str) -> VariantProfile:
        for v in self.variants:
            if v.variant == name:
                return v
        known = ", ".join(v.variant for v in self.variants)
        raise KeyError(f"context {self.context_id!r} has no variant {name!r} (has: {known})")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a context lives and in which form; ``tier is None`` means dropped."""

    variant: str
    tier: str | None

    @property
    def dropped(self) -> bool:
        return self.tier is None


DROPPED = Placement(variant=ORIGINAL_VARIANT, tier=None)


class OpKind(enum.Enum):
    """Plan operations (DESIGN.md §2): place a new context, compress in place, move, drop."""

    PLACE = "place"
    COMPRESS = "compress"
    MOVE = "move"
    DROP = "drop"


@dataclass(frozen=True, slots=True)
class Operation:
    """One step of a plan: bring ``context_id`` from ``source`` to ``target``."""

    kind: OpKind
    context_id: str
    source: Placement
    target: Placement
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Plan:
    """An ordered list of operations; executing them in order keeps every tier within capacity."""

    operations: tuple[Operation, ...] = field(default_factory=tuple)

    def __bool__(self) -> bool:
        return bool(self.operations)

    def __add__(self, other: Plan) -> Plan:
        return Plan(self.operations + other.operations)
