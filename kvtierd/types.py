"""Typed values shared by every layer: objects, variants, placements, plans, profiles.

Vocabulary (DESIGN.md §2): a *context* is a reusable token prefix and its KV cache; a *variant*
is a form of a context's KV (``none`` is the original); an *object* is a stored blob; a *tier*
is a storage level; a *placement* is ``(variant, tier)`` or dropped; a *plan* is an ordered list
of operations produced by a placer.
"""

from __future__ import annotations

import enum
from dataclasses import FrozenInstanceError, dataclass, field
from typing import Any

ORIGINAL_VARIANT = "none"
"""Name of the uncompressed variant of every context (ratio 1.0)."""


@dataclass(frozen=True, slots=True)
class ObjectKind:
    """The fields of an object that most objects share with many others (one model's chunks:
    one variant, dtype, shape, layout, tenant, token count): one instance for all of them
    (:meth:`of`), referenced by each :class:`ObjectMeta`."""

    variant: str = ORIGINAL_VARIANT
    dtype: str = "uint8"
    shape: tuple[int, ...] = ()
    layout: str = ""
    tenant: str = ""
    token_count: int = 0
    durable: bool = False

    @staticmethod
    def of(*, variant: str, dtype: str, shape: tuple[int, ...], layout: str, tenant: str,
           token_count: int, durable: bool) -> ObjectKind:  # fmt: skip
        """The shared instance with these fields (a new one once :data:`_KINDS_HELD` distinct
        kinds are held: sharing saves memory, it is never needed for correctness)."""
        fields = (variant, dtype, shape, layout, tenant, token_count, durable)
        kind = _KINDS.get(fields)
        if kind is None:
            if len(_KINDS) >= _KINDS_HELD:
                _KINDS.clear()  # kinds from hostile or unusual puts must not pile up
            kind = _KINDS[fields] = ObjectKind(*fields)
        return kind


_KINDS: dict[tuple[object, ...], ObjectKind] = {}
_KINDS_HELD = 4096

_OBJECT_FIELDS = (
    "key", "size_bytes", "context_id", "variant", "dtype", "shape", "layout", "token_count",
    "kept_indices", "tenant", "checksum", "durable", "parent_context_id", "position",
)  # fmt: skip


class ObjectMeta:
    """What the daemon knows about one stored object, independent of the tier holding it.

    ``layout`` is a free-form descriptor of the tensor layout (e.g. ``"KV_2LTD"``);
    ``kept_indices`` is an opaque little-endian int32 array (kept token positions of a
    compressed variant), empty for originals. ``checksum`` is xxh3_64 of the bytes (0 = not yet
    computed, e.g. while an object lives only in shared memory). ``durable``: committed durable
    (kept with its persistent copies, so that a restart still knows the placer may not drop
    it before it is read: docs/daemon.md). ``parent_context_id``: the context this object's
    context continues (a branch after a shared prefix, issue 29; "" = a root), kept with
    persistent copies so that the tree survives a restart. ``position``: the object's place in
    its context's order (issue 31), numbered as chunks join it and kept with persistent copies
    so that a restart lists them in put order (``ssd_format.check_position_field``); ``None``:
    not numbered yet (a put not indexed yet), or a copy written before positions were kept.

    Immutable (:meth:`replace` makes a changed copy), compared and hashed by those fields.
    The fields most objects share with others are one :class:`ObjectKind` (``kind``), read
    through properties of their own names: a daemon holds one of these per stored object, a
    million of them at issue 42's scale, and seven slots fewer is 56 bytes an object.
    """

    __slots__ = (
        "checksum",
        "context_id",
        "kept_indices",
        "key",
        "kind",
        "parent_context_id",
        "position",
        "size_bytes",
    )  # fmt: skip
    key: str
    size_bytes: int
    context_id: str
    kind: ObjectKind
    kept_indices: bytes
    checksum: int
    parent_context_id: str
    position: int | None

    def __init__(
        self,
        key: str,
        size_bytes: int,
        context_id: str = "",
        *,
        variant: str = ORIGINAL_VARIANT,
        dtype: str = "uint8",
        shape: tuple[int, ...] = (),
        layout: str = "",
        token_count: int = 0,
        kept_indices: bytes = b"",
        tenant: str = "",
        checksum: int = 0,
        durable: bool = False,
        parent_context_id: str = "",
        position: int | None = None,
    ) -> None:
        kind = ObjectKind.of(variant=variant, dtype=dtype, shape=shape, layout=layout,
                             tenant=tenant, token_count=token_count, durable=durable)  # fmt: skip
        _set_fields(self, key, size_bytes, context_id, kind, kept_indices, checksum,
                    parent_context_id, position)  # fmt: skip

    @classmethod
    def of_kind(cls, key: str, size_bytes: int, context_id: str, kind: ObjectKind, *,
                kept_indices: bytes = b"", checksum: int = 0, parent_context_id: str = "",
                position: int | None = None) -> ObjectMeta:  # fmt: skip
        """An object of a ``kind`` the caller holds already (a restart's many rows)."""
        meta = cls.__new__(cls)
        _set_fields(meta, key, size_bytes, context_id, kind, kept_indices, checksum,
                    parent_context_id, position)  # fmt: skip
        return meta

    def replace(self, **changes: Any) -> ObjectMeta:
        """A copy with ``changes`` (field names as the constructor's)."""
        unknown = changes.keys() - _OBJECT_FIELDS
        if unknown:
            raise TypeError(f"ObjectMeta has no field {sorted(unknown)[0]!r}")
        return ObjectMeta(**{name: getattr(self, name) for name in _OBJECT_FIELDS} | changes)

    @property
    def variant(self) -> str:
        return self.kind.variant

    @property
    def dtype(self) -> str:
        return self.kind.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.kind.shape

    @property
    def layout(self) -> str:
        return self.kind.layout

    @property
    def tenant(self) -> str:
        return self.kind.tenant

    @property
    def token_count(self) -> int:
        return self.kind.token_count

    @property
    def durable(self) -> bool:
        return self.kind.durable

    @property
    def context(self) -> str:
        """The context this object belongs to; an object without one is its own context."""
        return self.context_id or self.key

    def _fields(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in _OBJECT_FIELDS)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not ObjectMeta:
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in _OBJECT_FIELDS)
        return f"ObjectMeta({fields})"

    def __setattr__(self, name: str, value: object) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")


_set_object = object.__setattr__


def _set_fields(  # noqa: PLR0917 (positional: once an object at a restart of 1M)
    meta: ObjectMeta, key: str, size_bytes: int, context_id: str, kind: ObjectKind,
    kept_indices: bytes, checksum: int, parent_context_id: str, position: int | None,
) -> None:  # fmt: skip
    _set_object(meta, "key", key)
    _set_object(meta, "size_bytes", size_bytes)
    _set_object(meta, "context_id", context_id)
    _set_object(meta, "kind", kind)
    _set_object(meta, "kept_indices", kept_indices)
    _set_object(meta, "checksum", checksum)
    _set_object(meta, "parent_context_id", parent_context_id)
    _set_object(meta, "position", position)


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
