"""Whether the plugin's daemon answers, and getting back to it whatever starts first.

In a pod the vLLM container and the kvtierd sidecar start, and restart, in no fixed order.
The plugin therefore never needs the daemon to exist: while it does not answer, lookups are
misses and puts are dropped (vLLM prefills, as without a cache), one WARNING says so, and a
probe thread asks the daemon's status every ``probe_period_s`` until it answers; then the
plugin caches again (one INFO line: the outage's length and the stores dropped during it,
``dropped``) after ``on_connected`` ran (e.g. registering the model
card, which a new daemon does not know). Together with the client's bounded reconnect backoff
(``client.common.RECONNECT_BACKOFF_MS``), and a new channel every ``RECONNECT_EVERY_S`` while it
is down (``KVClient.reconnect``), a restarted daemon is used again within about a second.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvtierd.client import KVClient
from kvtierd.errors import UnavailableError

logger = logging.getLogger(__name__)

PROBE_PERIOD_S = 0.25
RECONNECT_EVERY_S = 1.0


class DaemonLink:
    """The up/down state of the plugin's connection; thread-safe."""

    def __init__(
        self,
        client: KVClient,
        on_connected: Callable[[], None],
        probe_period_s: float = PROBE_PERIOD_S,
    ) -> None:
        self.client = client
        self.on_connected = on_connected
        self.probe_period_s = probe_period_s
        self.version = ""
        self._lock = threading.Lock()
        self._up = False
        self._down_since = time.monotonic()
        self._probe: threading.Thread | None = None
        self._closed = threading.Event()
        self._dropped_chunks = 0  # stores dropped in the current outage, told at its end
        self._dropped_puts = 0

    @property
    def up(self) -> bool:
        return self._up

    def connect(self) -> bool:
        """One attempt now (at start-up); when it fails, the WARNING and the probe."""
        if self._try():
            return True
        self.lost(None)
        return False

    def lost(self, e: UnavailableError | None) -> None:
        """A call found the daemon unreachable: warn once for this outage, start probing."""
        with self._lock:
            if self._closed.is_set() or (not self._up and self._probe is not None):
                return
            was_up, self._up = self._up, False
            if was_up:
                self._down_since = time.monotonic()
            self._probe = threading.Thread(target=self._run, name="kvtierd-link", daemon=True)
            self._probe.start()
        logger.warning(
            "kvtierd plugin: kvtierd at %s does not answer%s; vLLM serves without it (lookups "
            "miss, stores are dropped) and the plugin reconnects as soon as it answers",
            self.client.endpoint.target, f" ({e})" if e is not None else "",
        )  # fmt: skip

    def dropped(self, chunks: int) -> None:
        """A put of ``chunks`` was not stored because the daemon did not answer."""
        with self._lock:
            self._dropped_chunks += chunks
            self._dropped_puts += 1

    def _try(self) -> bool:
        try:
            status = self.client.status()
            self.on_connected()
        except Exception as e:  # any failure here only means: not back yet
            logger.debug("kvtierd plugin: daemon not reachable yet: %s", e)
            return False
        with self._lock:
            self._up, self.version = True, status.version
            self._probe = None
        return True

    def _run(self) -> None:
        reconnected = time.monotonic()
        while not self._closed.wait(self.probe_period_s):
            if time.monotonic() - reconnected >= RECONNECT_EVERY_S:
                # A fresh channel: the old one may wait out a long backoff (KVClient.reconnect).
                self.client.reconnect()
                reconnected = time.monotonic()
            if self._try():
                with self._lock:
                    chunks, puts = self._dropped_chunks, self._dropped_puts
                    self._dropped_chunks = self._dropped_puts = 0
                logger.info(
                    "kvtierd plugin: kvtierd %s at %s answers again after an outage of %.1f s; "
                    "caching again (%d chunks of %d puts were NOT stored during it)",
                    self.version, self.client.endpoint.target,
                    time.monotonic() - self._down_since, chunks, puts,
                )  # fmt: skip
                return

    def close(self) -> None:
        self._closed.set()
