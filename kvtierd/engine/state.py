"""The engine's records: objects, contexts, allocations, leases, and the running policy.

These are mutable and private to the engine (the one owner of index state); the rest of the
system sees frozen :mod:`kvtierd.types` values.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvtierd.engine.key_set import KeySet
from kvtierd.policy_config import PolicyConfig
from kvtierd.storage.allocator import Block
from kvtierd.types import ORIGINAL_VARIANT, ObjectMeta


@dataclass(slots=True)
class ObjectRecord:
    """One object: where its bytes are (``tier``) and, if written through, a persistent copy."""

    meta: ObjectMeta
    tier: str
    shadow: str = ""  # a persistent tier also holding the bytes (durable commit), or ""
    durable: bool = False  # committed durable (or found on persistent storage at start)
    # Committed durable and not read since (this start): the placer may not drop it.
    unread: bool = False


@dataclass(slots=True)
class ContextRecord:
    """One context: its objects (in put order), access statistics and protection."""

    context_id: str
    variant: str = ORIGINAL_VARIANT
    tenant: str = ""
    namespace: str = ""  # the configured namespace of its tenant its first object names
    keys: KeySet = field(default_factory=KeySet)  # in put order; one key without a dict
    size_bytes: int = 0
    hits: int = 0
    last_access_s: float = 0.0
    pinned: bool = False
    hold_until_s: float = 0.0
    _lock: asyncio.Lock | None = field(default=None, repr=False)
    # The object that marks a daemon-made variant complete (written last), and its tier.
    marker: tuple[ObjectMeta, str] | None = None
    # The original's objects (meta, tier) kept in an unbounded tier while the context is
    # stored compressed (EvicPress keeps every original on its remote disk, §4).
    reference: list[tuple[ObjectMeta, str]] | None = None
    # The placer dropped the context, but it holds unread durable objects: they stay on a
    # persistent tier, outside the placer's view, until read, deleted or evicted.
    durable_held: bool = False
    # The context whose prefix this one continues ("" = a root; issue 29, engine/tree_joins.py)
    # and the key of the parent's chunk it follows ("" = the parent's last, or not known).
    parent: str = ""
    after_key: str = ""
    # The position the next object joining the context gets (ObjectMeta.position): one past
    # the highest it has held, so that positions only grow, even after a chunk is removed.
    next_position: int = 0

    @property
    def lock(self) -> asyncio.Lock:
        """Held while the context's bytes move or are read (made on first use: an
        ``asyncio.Lock`` is ~350 bytes, and most contexts of a large daemon never need one)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock


@dataclass(slots=True)
class AllocationRecord:
    """A put in flight: a staged arena block the client is writing."""

    allocation_id: str
    meta: ObjectMeta
    block: Block
    deadline_s: float
    created_s: float


@dataclass(slots=True)
class LeaseRecord:
    """A reader's claim on a block: the block is neither moved nor freed under it.

    ``pool`` names the tier whose memory holds ``block``: the CPU tier's arena (objects of the
    CPU tier, and objects staged from slower tiers), or a gpu tier for an in-place device lease.
    """

    lease_id: str
    meta: ObjectMeta
    tier: str
    block: Block
    deadline_s: float
    pool: str


@dataclass(slots=True)
class RunningPolicy:
    """The policy the daemon runs, shared by the parts that read it (placing, profiling, write
    advice); a hot reload swaps ``current`` (``AdminOps.apply_policy``)."""

    current: PolicyConfig
