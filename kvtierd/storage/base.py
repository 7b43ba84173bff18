"""The tier interface, the tier registry and online transfer-time tracking.

A tier stores objects (bytes + :class:`~kvtierd.types.ObjectMeta`) under string keys. Tiers do
not decide anything: the engine owns placement and calls them. Each tier reports its capacity,
used bytes, object count and a fit of its read/write time (per-transfer overhead + bandwidth,
:class:`TransferMeter`) — calibrated at start, updated from real transfers — so the placer's
TTFT model tracks the machine rather than assuming it.

Data moves through ``memoryview`` s: callers hand a view over the bytes to ``put`` and a view
to fill to ``read_into`` (usually a region of the CPU tier's shared-memory arena, page-aligned,
which lets the SSD tier use O_DIRECT). Tiers never allocate a fresh buffer per object on the
hot path: a fresh large allocation costs ~10x the copy (notes/machine-limits.md).
"""

from __future__ import annotations

import abc
import logging
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from kvtierd.errors import ConfigError
from kvtierd.registry import Registry
from kvtierd.types import ObjectMeta, TierStats

if TYPE_CHECKING:
    from kvtierd.config import TierConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TransferFit:
    """``seconds(nbytes) = overhead_s + nbytes / bytes_per_s``; ``bytes_per_s == 0`` means
    unknown (nothing measured yet)."""

    overhead_s: float = 0.0
    bytes_per_s: float = 0.0

    def seconds(self, nbytes: int) -> float:
        if self.bytes_per_s <= 0:
            return math.inf
        return self.overhead_s + nbytes / self.bytes_per_s

    def then(self, other: TransferFit) -> TransferFit:
        """This transfer followed by ``other`` (e.g. an SSD read into the arena, then the
        reader's copy out of it): overheads add, and so do seconds per byte."""
        if self.bytes_per_s <= 0 or other.bytes_per_s <= 0:
            return TransferFit(self.overhead_s + other.overhead_s, 0.0)
        per_byte = 1 / self.bytes_per_s + 1 / other.bytes_per_s
        return TransferFit(self.overhead_s + other.overhead_s, 1 / per_byte)


@dataclass(slots=True)
class TransferMeter:
    """Online fit of ``seconds = overhead_s + nbytes / bytes_per_s`` over real transfers.

    Per transfer, seconds per byte ``q = seconds / nbytes`` is regressed on ``p = 1 / nbytes``:
    ``q = a p + b`` with ``a`` the overhead and ``b`` seconds per byte — least squares on the
    error per byte, i.e. relative to the size, so a 1 MiB load 20 % off weighs about as much
    as a 64 MiB one 20 % off (the TTFT model is judged by ratios), while a transfer's weight
    does not depend on how fast the device was (an error relative to the *time* would let old
    fast transfers outweigh many new slow ones). Exponentially weighted: each transfer's
    weight decays by ``1 - weight`` per later one, so the fit follows the machine.

    A ridge term ``ridge * sum(w p^2) * (a - a_prev)^2`` pulls the overhead towards its
    previous value. With transfers of several sizes the data outweigh it; with transfers of
    one size only (overhead and bandwidth cannot be told apart) it holds the overhead where
    the last varied sizes put it and lets the bandwidth follow — instead of dividing by a
    determinant near zero.

    Transfers under ``min_bytes`` are ignored: KV objects are MiB-sized, and a few-KiB read
    is all latency (open, header, one random I/O) that does not lie on the line of the large
    ones, so fitting it would bend the line where it matters. Thread-safe (tiers move bytes
    on worker threads).
    """

    weight: float = 0.1
    ridge: float = 0.05
    min_bytes: int = 1 << 20
    samples: int = 0
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5, repr=False)
    _fit: TransferFit = TransferFit()
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def bytes_per_s(self) -> float:
        return self._fit.bytes_per_s

    @property
    def overhead_s(self) -> float:
        return self._fit.overhead_s

    def fit(self) -> TransferFit:
        return self._fit

    def record(self, nbytes: int, seconds: float) -> None:
        if nbytes < max(self.min_bytes, 1) or not 0 < seconds < math.inf:
            return
        p, q = 1 / nbytes, seconds / nbytes
        terms = (p * p, p, 1.0, p * q, q)
        with self._lock:
            keep = 1 - self.weight if self.samples else 0.0
            self._sums = [
                keep * s + self.weight * t for s, t in zip(self._sums, terms, strict=True)
            ]
            self.samples += 1
            self._fit = _solve(self._sums, self._fit.overhead_s, self.ridge)


def _solve(sums: list[float], prev_overhead_s: float, ridge: float) -> TransferFit:
    """The normal equations of :class:`TransferMeter`'s fit, with ``a >= 0`` and ``b > 0``."""
    pp, p, w, pq, q = sums
    pp_ridge, pq_pulled = pp * (1 + ridge), pq + ridge * pp * prev_overhead_s
    det = pp_ridge * w - p * p  # >= ridge * pp * w > 0 (Cauchy-Schwarz)
    a, b = (pq_pulled * w - p * q) / det, (pp_ridge * q - p * pq_pulled) / det
    if a < 0 or b <= 0:
        a, b = 0.0, q / w  # no overhead: the mean seconds per byte, always positive
    return TransferFit(a, 1 / b)


class Timer:
    """``with Timer() as t: ...`` then ``t.seconds``."""

    def __enter__(self) -> Timer:
        self._start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._start


class Tier(abc.ABC):
    """A storage level. Implementations are found by ``kind`` in :data:`TIERS`.

    Every tier is constructed the same way, from its :class:`~kvtierd.config.TierConfig`, and
    becomes usable after ``await start()``.
    """

    kind: ClassVar[str]
    persistent: ClassVar[bool] = False
    """Objects survive a daemon restart (the engine writes durable commits through to it)."""
    shared: ClassVar[bool] = False
    """Other daemons store objects in it too: the engine asks it about keys it does not know."""
    read_prior: ClassVar[TransferFit] = TransferFit(0.002, 0.1e9)
    """The load time the TTFT model assumes until a read is timed (a start-up calibration that
    could not run): a conservative figure for the kind (docs/daemon.md, "Load times"), never
    0 — an unknown bandwidth priced every load of the tier as infinitely slow."""

    def __init__(self, config: TierConfig) -> None:
        self.config = config
        self.name = config.name
        self.capacity_bytes = config.capacity_bytes
        # How long a lookup may wait on a shared tier about keys it does not hold (seconds):
        # a lookup never waits on the tier longer (engine/shared_lookups.py).
        self.lookup_budget_s = math.inf
        self.read_meter = TransferMeter()
        self.write_meter = TransferMeter()
        self.calibration_error = ""  # why the start-up calibration did not time a read

    def load_fit(self) -> TransferFit:
        """The tier's read fit: measured (calibration, real reads), else :attr:`read_prior`."""
        fit = self.read_meter.fit()
        return fit if fit.bytes_per_s > 0 else self.read_prior

    def calibration_failed(self, reason: str) -> None:
        """Record (and log, once) that the start-up calibration could not time a read."""
        self.calibration_error = reason
        prior = self.read_prior
        logger.warning(
            "tier %s (%s): bandwidth not calibrated: %s; until reads are timed the TTFT model "
            "assumes the %s prior of %.2f GB/s + %.2f ms per load",
            self.name, self.kind, reason, self.kind, prior.bytes_per_s / 1e9,
            prior.overhead_s * 1e3,
        )  # fmt: skip

    def calibration_detail(self) -> str:
        """For ``kvtierctl tiers``: what the load model rests on while no read was timed."""
        if self.read_meter.bytes_per_s > 0:
            return ""
        prior = self.read_prior
        why = self.calibration_error or "no read timed yet"
        return (
            f"bandwidth not calibrated ({why}); assuming {prior.bytes_per_s / 1e9:.2f} GB/s + "
            f"{prior.overhead_s * 1e3:.2f} ms per load ({self.kind} prior)"
        )

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

    async def relabel(self, meta: ObjectMeta) -> None:
        """Give the stored object ``meta.key`` the context identity of ``meta``
        (``context_id``, ``parent_context_id``), its bytes and checksum unchanged: a context
        split at a branch (issue 29, ``engine/tree_joins.py``) must be found split after a
        restart. A tier whose objects do not outlive the process keeps no identity to change;
        a persistent tier rewrites its stored header. Raises ``NotFoundError`` if absent."""
        self.get_meta(meta.key)

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

    @property
    def healthy(self) -> bool:
        """Whether the tier can serve now; cheap, for the lookup path (stats() says it too)."""
        return True

    def stats(self) -> TierStats:
        return TierStats(
            name=self.name,
            capacity_bytes=self.capacity_bytes,
            used_bytes=self.used_bytes(),
            object_count=self.object_count(),
            read_bandwidth_bytes_per_s=self.read_meter.bytes_per_s,
            write_bandwidth_bytes_per_s=self.write_meter.bytes_per_s,
            detail=self.calibration_detail(),
        )


TIERS: Registry[Tier] = Registry(
    "tier kind",
    Tier,
    {
        "cpu": "kvtierd.storage.cpu:CpuTier",
        "gpu": "kvtierd.storage.gpu:GpuTier",
        "ssd": "kvtierd.storage.ssd:SsdTier",
        "remote": "kvtierd.storage.remote:RemoteTier",
    },
    name_attr="kind",
    error=ConfigError,
)
"""Tier implementations by ``kind`` (built-ins imported on first lookup; others register with
``TIERS.register``)."""


def create_tier(config: TierConfig) -> Tier:
    """Construct a tier from its config, naming the tier when construction fails."""
    cls = TIERS.get(config.kind)
    try:
        return cls(config)
    except (OSError, ValueError) as e:
        raise ConfigError(f"tier {config.name!r} ({config.kind}): {e}") from e
