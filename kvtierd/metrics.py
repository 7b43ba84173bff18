"""Prometheus metrics of one daemon, served on an opt-in HTTP port (``metrics_port``).

One :class:`Metrics` per daemon, with its own ``CollectorRegistry`` (no process globals, so
tests and several daemons in one process never collide). The engine and the servicers call the
``observe_*``/``record_*``/``set_*`` methods; ``start_http_server`` serves ``/metrics``.

Exported series (all prefixed ``kvtierd_``)::

    tier_capacity_bytes{tier}, tier_used_bytes{tier}, tier_objects{tier}     gauges
    tier_healthy{tier}                                                        gauge 1/0
    namespace_used_bytes{tenant,namespace,tier}, namespace_quota_bytes{...}   gauges
      (configured namespaces only, issue 41.2; a quota of -1: none in that tier)
    hits_total{tier}, misses_total       chunks read, chunks not found or not read  counters
    lookups_total{outcome}               served requests' lookups: hit, partial, miss  counter
    lookup_decisions_total{decision}     found prompts: load, recompute, split  counter
    tier_hit_ratio{tier}       hits in this tier / all lookups since start    gauge
    load_seconds{tier}, store_seconds{tier}                                   histograms
    load_bytes_total{tier}, store_bytes_total{tier}                           counters
    placements_total{method,ratio,tier}   placement decisions (tier "dropped")  counter
    placed_contexts{method,ratio,tier}    current placements                   gauge
    profiler_runs_total{outcome}, profiler_run_seconds                        counter, histogram
    plan_operations_total{kind}           place / compress / move / drop      counter
    durable_holds_total                   drops refused for unread durable objects  counter
    errors_total{code}                    gRPC status code names              counter
    healthy                               1 when the daemon is SERVING         gauge

Methods are safe to call from any thread (prometheus-client locks per sample).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

import prometheus_client as prom

from kvtierd.types import ORIGINAL_VARIANT
from kvtierd.variants import parse_variant

logger = logging.getLogger(__name__)

DROPPED_TIER = "dropped"
"""``tier`` label of a placement that keeps no bytes (served by full prefill)."""

# Latencies from a few microseconds (shared-memory hit) to seconds (remote tier, large context).
_LATENCY_BUCKETS_S = (
    1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)  # fmt: skip
_PROFILE_BUCKETS_S = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)


@dataclass(frozen=True, slots=True)
class VariantLabels:
    """``method`` and ``ratio`` labels of a variant name (``knorm@0.5+int8`` -> ``knorm+int8``,
    ``0.5``; ``int8`` -> ``int8``, ``1``; ``none`` -> ``none``, ``1``)."""

    method: str
    ratio: str

    @classmethod
    def of(cls, variant: str) -> VariantLabels:
        try:
            v = parse_variant(variant or ORIGINAL_VARIANT)
        except ValueError:  # a client's own name for its object: shown as it is
            return cls(method=variant, ratio="1")
        return cls(method=v.method_name, ratio=f"{v.ratio:g}")


class Metrics:
    """All metrics of one daemon. ``tier`` arguments are tier names from the daemon config."""

    def __init__(self) -> None:
        self.registry = prom.CollectorRegistry(auto_describe=True)
        r = self.registry
        tier = ("tier",)
        self._capacity = prom.Gauge("kvtierd_tier_capacity_bytes", "Tier capacity (0 = unbounded)",
                                    tier, registry=r)  # fmt: skip
        self._used = prom.Gauge("kvtierd_tier_used_bytes", "Bytes stored in the tier", tier,
                                registry=r)  # fmt: skip
        self._objects = prom.Gauge("kvtierd_tier_objects", "Objects stored in the tier", tier,
                                   registry=r)  # fmt: skip
        self._tier_healthy = prom.Gauge("kvtierd_tier_healthy", "1 when the tier works", tier,
                                        registry=r)  # fmt: skip
        space = ("tenant", "namespace", "tier")
        self._ns_used = prom.Gauge("kvtierd_namespace_used_bytes",
                                   "Bytes a tenant's namespace keeps in the tier", space,
                                   registry=r)  # fmt: skip
        self._ns_quota = prom.Gauge("kvtierd_namespace_quota_bytes",
                                    "A namespace's quota in the tier (-1: none)", space,
                                    registry=r)  # fmt: skip
        self._hits = prom.Counter("kvtierd_hits", "Lookups answered from the tier", tier,
                                  registry=r)  # fmt: skip
        self._misses = prom.Counter(
            "kvtierd_misses",
            "Chunks a served request's lookup did not find (after its found prefix), and reads "
            "that found nothing",
            registry=r,
        )
        self._request_lookups = prom.Counter(
            "kvtierd_lookups", "Served requests' lookups by outcome (hit, partial, miss)",
            ("outcome",), registry=r,
        )  # fmt: skip
        for outcome in ("hit", "partial", "miss"):  # each series exists from the start
            self._request_lookups.labels(outcome)
        self._lookup_decisions = prom.Counter(
            "kvtierd_lookup_decisions",
            "Lookups that found chunks, by what they reported: load all, recompute all, or "
            "split (load a prefix, recompute the rest)",
            ("decision",),
            registry=r,
        )
        for decision in ("load", "recompute", "split"):  # each series exists from the start
            self._lookup_decisions.labels(decision)
        self._hit_ratio = prom.Gauge("kvtierd_tier_hit_ratio",
                                     "Hits in the tier / all lookups since start", tier,
                                     registry=r)  # fmt: skip
        self._load_s = prom.Histogram("kvtierd_load_seconds", "Time to serve a get from the tier",
                                      tier, buckets=_LATENCY_BUCKETS_S, registry=r)  # fmt: skip
        self._store_s = prom.Histogram("kvtierd_store_seconds", "Time to store into the tier",
                                       tier, buckets=_LATENCY_BUCKETS_S, registry=r)  # fmt: skip
        self._load_bytes = prom.Counter("kvtierd_load_bytes", "Bytes served from the tier", tier,
                                        registry=r)  # fmt: skip
        self._store_bytes = prom.Counter("kvtierd_store_bytes", "Bytes stored into the tier",
                                         tier, registry=r)  # fmt: skip
        placement = ("method", "ratio", "tier")
        self._placements = prom.Counter("kvtierd_placements", "Placement decisions", placement,
                                        registry=r)  # fmt: skip
        self._placed = prom.Gauge("kvtierd_placed_contexts", "Contexts currently placed so",
                                  placement, registry=r)  # fmt: skip
        self._profile_runs = prom.Counter("kvtierd_profiler_runs", "Profiler runs", ("outcome",),
                                          registry=r)  # fmt: skip
        self._profile_s = prom.Histogram("kvtierd_profiler_run_seconds", "Profiler run duration",
                                         buckets=_PROFILE_BUCKETS_S, registry=r)  # fmt: skip
        self._operations = prom.Counter("kvtierd_plan_operations", "Executed plan operations",
                                        ("kind",), registry=r)  # fmt: skip
        self._durable_holds = prom.Counter(
            "kvtierd_durable_holds",
            "Placer drops or compressions refused: the context held durable objects not read yet",
            registry=r,
        )
        self._errors = prom.Counter("kvtierd_errors", "Requests answered with an error status",
                                    ("code",), registry=r)  # fmt: skip
        self._healthy = prom.Gauge("kvtierd_healthy", "1 when the daemon is SERVING", registry=r)
        self._lock = threading.Lock()
        self._tier_hits: dict[str, int] = {}
        self._ratio_tiers: set[str] = set()
        self._lookups = 0
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    # -- tiers ------------------------------------------------------------------------------

    def set_tier_state(
        self, tier: str, used_bytes: int, objects: int, capacity_bytes: int, healthy: bool = True
    ) -> None:
        """The tier's current occupancy; call after each change or periodically."""
        self._capacity.labels(tier).set(capacity_bytes)
        self._used.labels(tier).set(used_bytes)
        self._objects.labels(tier).set(objects)
        self._tier_healthy.labels(tier).set(1 if healthy else 0)
        self._ensure_tier(tier)

    def set_namespace_state(
        self, tenant: str, namespace: str, tier: str, used_bytes: int, quota_bytes: int | None
    ) -> None:
        """A configured namespace's bytes in a tier, and its quota there (``None``: none)."""
        self._ns_used.labels(tenant, namespace, tier).set(used_bytes)
        self._ns_quota.labels(tenant, namespace, tier).set(
            -1 if quota_bytes is None else quota_bytes
        )

    def record_hit(self, tier: str) -> None:
        """A lookup found its object in ``tier``."""
        self._hits.labels(tier).inc()
        with self._lock:
            self._tier_hits[tier] = self._tier_hits.get(tier, 0) + 1
            self._lookups += 1
        self._ensure_tier(tier)

    def record_lookup_decision(self, decision: str) -> None:
        """A lookup's load-or-recompute decision (``engine/lookup_decision.py``)."""
        self._lookup_decisions.labels(decision).inc()

    def record_miss(self, chunks: int = 1) -> None:
        """``chunks`` were found in no tier."""
        self._misses.inc(chunks)
        with self._lock:
            self._lookups += chunks

    def record_lookup(self, outcome: str, missed_chunks: int) -> None:
        """A served request's lookup ended so (``hit``, ``partial``, ``miss``), not finding
        ``missed_chunks`` (each a miss, in every tier's hit ratio too)."""
        self._request_lookups.labels(outcome).inc()
        if missed_chunks:
            self.record_miss(missed_chunks)

    def observe_load(self, tier: str, seconds: float, nbytes: int) -> None:
        """A get served ``nbytes`` from ``tier`` in ``seconds``."""
        self._load_s.labels(tier).observe(seconds)
        self._load_bytes.labels(tier).inc(nbytes)

    def observe_store(self, tier: str, seconds: float, nbytes: int) -> None:
        """A put (or a move into ``tier``) wrote ``nbytes`` in ``seconds``."""
        self._store_s.labels(tier).observe(seconds)
        self._store_bytes.labels(tier).inc(nbytes)

    def _ensure_tier(self, tier: str) -> None:
        # The ratio is computed at scrape time so every tier's ratio moves with every lookup.
        with self._lock:
            if tier in self._ratio_tiers:
                return
            self._ratio_tiers.add(tier)
        self._hit_ratio.labels(tier).set_function(lambda: self._ratio(tier))

    def _ratio(self, tier: str) -> float:
        with self._lock:
            return self._tier_hits.get(tier, 0) / self._lookups if self._lookups else 0.0

    # -- placements, plans, profiler, errors ----------------------------------------------------

    def record_placement(self, variant: str, tier: str | None) -> None:
        """The placer put a context as ``variant`` in ``tier`` (``None``: dropped)."""
        labels = VariantLabels.of(variant)
        self._placements.labels(labels.method, labels.ratio, tier or DROPPED_TIER).inc()

    def set_placed_contexts(self, counts: Mapping[tuple[str, str | None], int]) -> None:
        """Current number of contexts per ``(variant, tier or None)``; replaces the previous."""
        self._placed.clear()
        for (variant, tier), n in counts.items():
            labels = VariantLabels.of(variant)
            self._placed.labels(labels.method, labels.ratio, tier or DROPPED_TIER).inc(n)

    def record_operation(self, kind: str) -> None:
        """An executed plan operation: ``place``, ``compress``, ``move`` or ``drop``."""
        self._operations.labels(kind).inc()

    def record_durable_hold(self) -> None:
        """A drop (or compression) the placer planned was refused: durable objects unread."""
        self._durable_holds.inc()

    def observe_profile_run(self, seconds: float, ok: bool = True) -> None:
        """A profiler run finished (``ok=False``: it failed)."""
        self._profile_runs.labels("ok" if ok else "failed").inc()
        self._profile_s.observe(seconds)

    def record_error(self, code: str) -> None:
        """A request ended with this gRPC status code name (``"NOT_FOUND"``, ...)."""
        self._errors.labels(code).inc()

    def set_healthy(self, healthy: bool) -> None:
        self._healthy.set(1 if healthy else 0)

    # -- exposition -----------------------------------------------------------------------------

    def render(self) -> bytes:
        """The text exposition format, as served on ``/metrics``."""
        return bytes(prom.generate_latest(self.registry))

    def start_http_server(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``addr:port`` in a daemon thread; port 0 picks a free port.

        Returns the bound port. Loopback by default: metrics name tiers and paths.
        """
        if self._server is not None:
            raise RuntimeError("the metrics HTTP server is already running")
        server, thread = prom.start_http_server(port, addr=addr, registry=self.registry)
        self._server, self._thread = server, thread
        bound = int(server.server_port)
        logger.info("metrics on http://%s:%d/metrics", addr, bound)
        return bound

    def close(self) -> None:
        """Stop the HTTP server, if any."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._server = self._thread = None
