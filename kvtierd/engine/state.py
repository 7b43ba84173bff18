"""The engine's records: objects, contexts, allocations, leases, and the running policy.

These are mutable and private to the engine (the one owner of index state); the rest of the
system sees frozen :mod:`kvtierd.types` values.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar, cast, overload

from kvtierd.engine.key_set import Held, KeySet
from kvtierd.policy_config import PolicyConfig
from kvtierd.storage.allocator import Block
from kvtierd.types import ORIGINAL_VARIANT, ObjectMeta

T = TypeVar("T")


class _Where(NamedTuple):
    """Where an object's bytes are and what its commit promised: few distinct values (tier
    names come from the configuration), each one object shared by every record having it."""

    tier: str
    shadow: str
    durable: bool
    unread: bool


@functools.cache
def _where(tier: str, shadow: str, durable: bool, unread: bool) -> _Where:
    return _Where(tier, shadow, durable, unread)


class ObjectRecord:
    """One object: where its bytes are (``tier``) and, if written through, a persistent copy
    (``shadow``, or ``""``). ``durable``: committed durable (or found on persistent storage at
    start); ``unread``: committed durable and not read since (this start), so the placer may
    not drop it.

    Issue 42 (a daemon of a million objects): the four fields are one shared :class:`_Where`,
    so a record is two slots (48 bytes, where five slots were 72); they read and set as
    attributes of their own names.
    """

    __slots__ = ("_where", "meta")

    def __init__(
        self,
        meta: ObjectMeta,
        tier: str,
        shadow: str = "",
        durable: bool = False,
        unread: bool = False,
    ) -> None:
        self.meta = meta
        self._where = _where(tier, shadow, durable, unread)

    @property
    def tier(self) -> str:
        return self._where.tier

    @tier.setter
    def tier(self, tier: str) -> None:
        self._where = _where(*self._where._replace(tier=tier))

    @property
    def shadow(self) -> str:
        return self._where.shadow

    @shadow.setter
    def shadow(self, shadow: str) -> None:
        self._where = _where(*self._where._replace(shadow=shadow))

    @property
    def durable(self) -> bool:
        return self._where.durable

    @durable.setter
    def durable(self, durable: bool) -> None:
        self._where = _where(*self._where._replace(durable=durable))

    @property
    def unread(self) -> bool:
        return self._where.unread

    @unread.setter
    def unread(self, unread: bool) -> None:
        self._where = _where(*self._where._replace(unread=unread))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ObjectRecord):
            return NotImplemented
        return self.meta == other.meta and self._where == other._where

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass it was

    def __repr__(self) -> str:
        w = self._where
        return (
            f"ObjectRecord(meta={self.meta!r}, tier={w.tier!r}, shadow={w.shadow!r}, "
            f"durable={w.durable!r}, unread={w.unread!r})"
        )


@dataclass(slots=True)
class _Rare:
    """What few contexts have, kept off :class:`ContextRecord` (six slots a context more at
    1M one-object contexts: issue 42). Read and written through :class:`_RareField`s."""

    # The context's lock and how many hold it or wait for it (:class:`ContextLock`).
    _lock: _LockState | None = None
    pinned: bool = False  # kept in its tier by an operator (kvtierctl pin)
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


_ALL_DEFAULT = _Rare()


class _RareField(Generic[T]):
    """An attribute of :class:`ContextRecord` kept in its :class:`_Rare` (made when a value
    other than the default is first set)."""

    def __init__(self, default: T) -> None:
        self.default = default
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, record: None, owner: type) -> _RareField[T]: ...
    @overload
    def __get__(self, record: ContextRecord, owner: type) -> T: ...
    def __get__(self, record: ContextRecord | None, owner: type) -> T | _RareField[T]:
        if record is None:
            return self
        rare = record._rare
        return self.default if rare is None else cast(T, getattr(rare, self.name))

    def __set__(self, record: ContextRecord, value: T) -> None:
        rare = record._rare
        if rare is None:
            if value == self.default:
                return
            rare = record._rare = _Rare()
        setattr(rare, self.name, value)
        if value == self.default and rare == _ALL_DEFAULT:
            record._rare = None  # nothing aside any more: the room goes with it


class _LockState:
    """A context's ``asyncio.Lock`` while anyone holds it or waits for it."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


class ContextLock:
    """``async with ctx.lock``: held while the context's bytes move or are read.

    The ``asyncio.Lock`` behind it (~350 bytes with its record) is made when a first user
    comes and let go when the last one leaves: a daemon moves nearly every context of a large
    cache down a tier once, and keeping each one's lock afterwards cost ~450 B a context at 1M
    one-object contexts (issue 42's 1 KB an object)."""

    __slots__ = ("_ctx",)

    def __init__(self, ctx: ContextRecord) -> None:
        self._ctx = ctx

    def locked(self) -> bool:
        state = self._ctx._lock
        return state is not None and state.lock.locked()

    async def __aenter__(self) -> None:
        ctx = self._ctx
        state = ctx._lock
        if state is None:
            state = ctx._lock = _LockState()
        state.users += 1
        try:
            await state.lock.acquire()
        except BaseException:
            self._leave(state)
            raise

    async def __aexit__(self, *exc: object) -> None:
        state = self._ctx._lock
        assert state is not None
        state.lock.release()
        self._leave(state)

    def _leave(self, state: _LockState) -> None:
        state.users -= 1
        if not state.users:
            self._ctx._lock = None


class _Names(NamedTuple):
    """A context's form, tenant and namespace: one value shared by the contexts having them."""

    variant: str
    tenant: str
    namespace: str


@functools.lru_cache(maxsize=4096)  # bounded: variant names come with puts
def _names(variant: str, tenant: str, namespace: str) -> _Names:
    return _Names(variant, tenant, namespace)


class ContextRecord:
    """One context: its objects (in put order), access statistics and protection.

    Issue 42 (a million contexts): its ``variant``, ``tenant`` and ``namespace`` (the
    configured namespace of its tenant its first object names) are one shared :class:`_Names`,
    and what few contexts have (pinned, a marker, a reference copy, a parent, ...) is in
    ``_rare``: nine slots, 104 bytes, where twelve were 128. All read and set as attributes of
    their own names.
    """

    __slots__ = (
        "_names",
        "_rare",
        "context_id",
        "held_keys",
        "hits",
        "hold_until_s",
        "last_access_s",
        "next_position",
        "size_bytes",
    )  # fmt: skip

    def __init__(
        self,
        context_id: str,
        variant: str = ORIGINAL_VARIANT,
        tenant: str = "",
        namespace: str = "",
        *,
        held_keys: Held = None,  # kept for :attr:`keys`
        size_bytes: int = 0,
        hits: int = 0,
        last_access_s: float = 0.0,
        pinned: bool = False,
        hold_until_s: float = 0.0,
        next_position: int = 0,
    ) -> None:
        self.context_id = context_id
        self._names = _names(variant, tenant, namespace)
        self.held_keys = held_keys
        self.size_bytes = size_bytes
        self.hits = hits
        self.last_access_s = last_access_s
        self.hold_until_s = hold_until_s
        # The position the next object joining the context gets (ObjectMeta.position): one
        # past the highest it has held, so that positions only grow after a chunk is removed.
        self.next_position = next_position
        self._rare: _Rare | None = None
        if pinned:
            self.pinned = True

    pinned = _RareField[bool](False)
    marker = _RareField[tuple[ObjectMeta, str] | None](None)
    reference = _RareField[list[tuple[ObjectMeta, str]] | None](None)
    durable_held = _RareField[bool](False)
    parent = _RareField[str]("")
    after_key = _RareField[str]("")
    _lock = _RareField[_LockState | None](None)

    @property
    def variant(self) -> str:
        return self._names.variant

    @variant.setter
    def variant(self, variant: str) -> None:
        self._names = _names(*self._names._replace(variant=variant))

    @property
    def tenant(self) -> str:
        return self._names.tenant

    @property
    def namespace(self) -> str:
        return self._names.namespace

    @property
    def keys(self) -> KeySet:
        """Its objects' keys, in put order (a view of :attr:`held_keys`)."""
        return KeySet(holder=self)

    @property
    def lock(self) -> ContextLock:
        """Held while the context's bytes move or are read (``async with ctx.lock``)."""
        return ContextLock(self)

    def __repr__(self) -> str:
        return (
            f"ContextRecord(context_id={self.context_id!r}, variant={self.variant!r}, "
            f"tenant={self.tenant!r}, size_bytes={self.size_bytes}, hits={self.hits})"
        )


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
