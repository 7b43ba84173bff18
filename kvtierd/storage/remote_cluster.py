"""Redis Cluster clients for the remote tier, how their errors are read, and tier health.

Two clients, one per direction, because each is the faster one for it (benchmarks/RESULTS.md,
"Remote tier on Redis Cluster"): the synchronous client on a worker thread writes 64 MiB objects
~3-4x faster than the asyncio one (asyncio's transport copies what the socket does not take at
once), and the asyncio client reads ~2x faster than the synchronous one (whose parser copies
every reply through a BytesIO). Both reconnect and refresh the slot map by themselves after a
node returns; retries are few and short so that a dead node costs a bounded time.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio.cluster as aio_cluster
import redis.asyncio.retry as aio_retry
import redis.cluster as sync_cluster
import redis.retry as sync_retry
from redis.backoff import ExponentialBackoff

from kvtierd.storage.remote_format import RemoteOptions

# Errors meaning "the cluster (or a node of it) cannot be reached right now": reads become
# misses and writes UnavailableError, and the tier reports itself unhealthy until a probe
# reaches every primary again. ClusterError covers CLUSTERDOWN and "TTL exhausted".
UNREACHABLE: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterError,
    redis.exceptions.TryAgainError,
    redis.exceptions.RedisClusterException,
    TimeoutError,
    OSError,
)

RETRIES = 2
_BACKOFF = {"cap": 0.2, "base": 0.02}  # seconds: slot-map refreshes, not patience


def _common_kwargs(opts: RemoteOptions) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "password": opts.password or None,
        "username": opts.username or None,
        "socket_connect_timeout": opts.connect_timeout_s,
        "socket_timeout": opts.socket_timeout_s,
        "decode_responses": False,
        "require_full_coverage": False,  # a dead master's slots miss; the others serve
        "socket_read_size": 1 << 20,
    }
    if opts.tls:
        kwargs["ssl"] = True
        if opts.tls_ca_file:
            kwargs["ssl_ca_certs"] = opts.tls_ca_file
    return kwargs


def make_sync_client(opts: RemoteOptions) -> sync_cluster.RedisCluster:
    """The writer client (used from worker threads and by the tier's synchronous methods)."""
    return sync_cluster.RedisCluster(
        startup_nodes=[
            sync_cluster.ClusterNode(h, p)  # type: ignore[no-untyped-call]
            for h, p in opts.nodes
        ],
        retry=sync_retry.Retry(ExponentialBackoff(**_BACKOFF), RETRIES),
        **_common_kwargs(opts),
    )


def make_async_client(opts: RemoteOptions) -> aio_cluster.RedisCluster:
    """The reader client (used on the event loop)."""
    return aio_cluster.RedisCluster(
        startup_nodes=[aio_cluster.ClusterNode(h, p) for h, p in opts.nodes],
        retry=aio_retry.Retry(ExponentialBackoff(**_BACKOFF), RETRIES),
        **_common_kwargs(opts),
    )


@dataclass(frozen=True, slots=True)
class HealthView:
    """The tier's reachability as last observed: ``detail`` names what failed and when."""

    healthy: bool
    detail: str


class ClusterHealth:
    """Reachability from two sources: every failed call marks the tier unhealthy at once; a
    background probe (``probe``) marks it healthy again only when every primary answers PING.
    Thread-safe (writes fail on worker threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._view = HealthView(True, "")

    @property
    def view(self) -> HealthView:
        with self._lock:
            return self._view

    def failed(self, what: str, error: BaseException) -> None:
        stamp = time.strftime("%H:%M:%S")
        with self._lock:
            self._view = HealthView(False, f"{what} failed at {stamp}: {error!r}")

    def probe_result(self, unreachable: list[str]) -> None:
        with self._lock:
            if unreachable:
                self._view = HealthView(False, f"unreachable: {', '.join(unreachable)}")
            else:
                self._view = HealthView(True, "")

    async def probe(self, client: aio_cluster.RedisCluster, timeout_s: float) -> None:
        """PING every known primary once, each bounded by ``timeout_s``."""
        unreachable: list[str] = []
        try:
            primaries = client.get_primaries()
        except UNREACHABLE as e:  # no slot map yet: the cluster was never reached
            self.failed("slot map", e)
            return
        for node in primaries:
            try:
                await asyncio.wait_for(client.ping(target_nodes=node), timeout_s)
            except UNREACHABLE:
                unreachable.append(f"{node.host}:{node.port}")
        if not primaries:
            unreachable.append("no primaries known")
        self.probe_result(unreachable)
