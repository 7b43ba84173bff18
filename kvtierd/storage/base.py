"""The tier interface, the tier registry and online bandwidth tracking.

A tier stores objects (bytes + :class:`~kvtierd.types.ObjectMeta`) under string keys. Tiers do
not decide anything: the engine owns placement and calls them. Each tier reports its capacity,
used bytes, object count and read/write bandwidth — calibrated at start, updated from real
transfers — so the placer's TTFT model tracks the machine rather than assuming it.

Data moves through ``memoryview`` s: callers hand a view over the bytes to ``put`` and a view
to fill to ``read_into`` (usually a region of the CPU tier's shared-memory arena, page-aligned,
which lets the SSD tier use O_DIRECT). Tiers never allocate a fresh buffer per object on the
hot path: a fresh large allocation costs ~10x the copy (notes/machine-limits.md).
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from kvtierd.errors import ConfigError
from kvtierd.types import ObjectMeta, TierStats

if TYPE_CHECKING:
    from kvtierd.config import TierConfig


@dataclass(slots=True)
class BandwidthMeter:
    """Exponentially weighted bandwidth estimate in bytes/s, updated from real transfers.

    Transfers smaller than ``min_bytes`` are ignored: their time is dominated by per-call
    overhead, not bandwidth. Thread-safe (tiers move bytes on worker threads).
    """

    bytes_per_s: float = 0.0
    weight: float = 0.2
    min_bytes: int = 1 << 20
    samples: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, nbytes: int, seconds: float) -> None:
        if nbytes < self.min_bytes or seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            if self.samples == 0:
                self.bytes_per_s = rate
            else:
                self.bytes_per_s += self.weight * (rate - self.bytes_per_s)
            self.samples += 1


class Timer:
    """``with Timer() as t: ...`` then ``t.seconds``."""

    def __enter__(self) -> Timer:
        self._start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._start


class Tier(abc.ABC):
    """A storage level. Implementations register with :func:`register_tier` under ``kind``.

    Every tier is constructed the same way, from its :class:`~kvtierd.config.TierConfig`, and
    becomes usable after ``await start()``.
    """

    kind: ClassVar[str]
    persistent: ClassVar[bool] = False
    """Objects survive a daemon restart (the engine writes durable commits through to it)."""
    shared: ClassVar[bool] = False
    """Other daemons store objects in it too: the engine asks it about keys it does not know."""

    def __init__(self, config: TierConfig) -> None:
        self.config = config
        self.name = config.name
        self.capacity_bytes = config.capacity_bytes
        self.read_meter = BandwidthMeter()
        self.write_meter = BandwidthMeter()

    @abc.abstractmethod
    async def start(self) -> None:
        """Open resources, rebuild the index from what is stored, calibrate bandwidth."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Flush and release resources. Objects of persistent tiers survive."""

    @abc.abstractmethod
    async def put(self, meta: ObjectMeta, data: memoryview) -> ObjectMeta:
        """Store ``data`` (``meta.size_bytes`` long) under ``meta.key``; return the stored meta.

        Raises ``AlreadyExistsError`` if the key is present, ``StorageFullError`` when the
        device has no room. Either the whole object is stored or nothing is.
        """

    @abc.abstractmethod
    async def read_into(self, key: str, dst: memoryview, *, tenant: str = "") -> ObjectMeta:
        """Copy the object's bytes into ``dst`` (at least ``size_bytes`` long).

        ``tenant`` is the object's ``meta.tenant``: a tier shared between daemons hashes it
        into its keys; a local tier may ignore it (the engine's keys are tenant-scoped).

        Raises ``NotFoundError``; ``CorruptObjectError`` when the stored bytes fail their check
        (the object is then quarantined and forgotten).
        """

    @abc.abstractmethod
    async def delete(self, key: str, *, tenant: str = "") -> None:
        """Remove the object; raises ``NotFoundError`` if absent."""

    @abc.abstractmethod
    def get_meta(self, key: str) -> ObjectMeta:
        """The object's metadata; raises ``NotFoundError``."""

    @abc.abstractmethod
    def metas(self) -> Iterator[ObjectMeta]:
        """Every object held (used to rebuild the engine's index at start)."""

    @abc.abstractmethod
    def used_bytes(self) -> int:
        """Bytes of objects held (excluding padding and transient staging)."""

    async def fetch_meta(self, key: str, *, tenant: str = "") -> ObjectMeta:
        """``get_meta`` for async callers; a shared tier asks its backend (another daemon may
        have stored the object since this one started)."""
        return self.get_meta(key)

    def contains(self, key: str) -> bool:
        try:
            self.get_meta(key)
        except KeyError:
            return False
        return True

    def object_count(self) -> int:
        return sum(1 for _ in self.metas())

    def stats(self) -> TierStats:
        return TierStats(
            name=self.name,
            capacity_bytes=self.capacity_bytes,
            used_bytes=self.used_bytes(),
            object_count=self.object_count(),
            read_bandwidth_bytes_per_s=self.read_meter.bytes_per_s,
            write_bandwidth_bytes_per_s=self.write_meter.bytes_per_s,
        )


TIERS: dict[str, type[Tier]] = {}


def register_tier(cls: type[Tier]) -> type[Tier]:
    """Class decorator: add a tier implementation to the registry under its ``kind``."""
    if not issubclass(cls, Tier):
        raise TypeError(f"{cls!r} is not a Tier")
    if cls.kind in TIERS:
        raise ValueError(f"tier kind {cls.kind!r} is already registered by {TIERS[cls.kind]!r}")
    TIERS[cls.kind] = cls
    return cls


def tier_class(kind: str) -> type[Tier]:
    """Look a tier implementation up by kind; an unknown kind lists the known ones."""
    import kvtierd.storage  # noqa: F401  (registers the built-in tiers)

    try:
        return TIERS[kind]
    except KeyError:
        known = ", ".join(sorted(TIERS))
        raise ConfigError(f"unknown tier kind {kind!r}; known kinds: {known}") from None


def create_tier(config: TierConfig) -> Tier:
    """Construct a tier from its config, naming the tier when construction fails."""
    cls = tier_class(config.kind)
    try:
        return cls(config)
    except (OSError, ValueError) as e:
        raise ConfigError(f"tier {config.name!r} ({config.kind}): {e}") from e
