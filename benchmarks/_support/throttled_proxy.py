"""A remote tier made slow on purpose: one ``redis-server`` cluster node behind a TCP proxy that
sleeps per block it forwards to the client (issue 41's load-or-recompute tests and benchmark).

The node announces the proxy's port (``cluster-announce-port``), so the cluster's own slot
map (``CLUSTER SLOTS``) sends the daemon's Redis Cluster clients through the proxy for every
command, the start-up calibration included: the tier's read fit measures the throttled link,
as it would a slow network. Replies are delayed by ``len(block) / bytes_per_s`` per block
read from Redis (at most 64 KiB), requests pass unthrottled.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks._support.redis_cluster import RedisClusterProcs

BLOCK = 64 << 10


class ThrottledProxy:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``target_port``; replies at ``bytes_per_s``."""

    def __init__(self, target_port: int, bytes_per_s: float) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s!r}")
        self.target_port = target_port
        self.bytes_per_s = bytes_per_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="throttled-proxy", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._closed:
                    client.close()
                    upstream.close()
                    return
                self._sockets += [client, upstream]
            for src, dst, delay in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(
                    target=self._pipe, args=(src, dst, delay), name="throttled-pipe", daemon=True
                ).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, throttled: bool) -> None:
        try:
            while block := src.recv(BLOCK):
                if throttled:
                    time.sleep(len(block) / self.bytes_per_s)
                dst.sendall(block)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets, self._sockets = self._sockets, []
        self._listener.close()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.close()


@contextlib.contextmanager
def throttled_redis(base_dir: Path, bytes_per_s: float) -> Iterator[tuple[str, ThrottledProxy]]:
    """A one-node Redis Cluster under ``base_dir`` reachable only through a
    :class:`ThrottledProxy`; yields the startup address for the remote tier's ``nodes``
    (the proxy's) and the proxy."""
    cluster = RedisClusterProcs(base_dir, masters=1)
    cluster.start()
    proxy: ThrottledProxy | None = None
    try:
        node = cluster.nodes[0]
        proxy = ThrottledProxy(node.port, bytes_per_s)
        with cluster.client(node.port) as c:
            c.execute_command("CONFIG", "SET", "cluster-announce-port", str(proxy.port))
        yield f"127.0.0.1:{proxy.port}", proxy
    finally:
        if proxy is not None:
            proxy.close()
        cluster.stop()
