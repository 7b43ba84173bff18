"""The router's probes and metrics, as Kubernetes reads them (issue 41).

* ``/livez`` (liveness): the router's event loop answers. Nothing else: a liveness probe that
  followed vLLM or the daemon would restart a router that has nothing wrong with it.
* ``/readyz`` (readiness): the router can answer requests, which needs vLLM and only vLLM
  (``upstream``): without the daemon every request is still served, from its real prompt
  (``app.py``). The daemon's state is reported beside it (``daemon``), never folded in: a
  readiness probe that followed the daemon took working routers out of service while it
  restarted.
* ``/health``: the same answer as ``/readyz`` with the router's counters.
* ``/metrics``: Prometheus text, ``kvtierd_router_upstream_up``, ``kvtierd_router_daemon_up``
  and the counters, each probed at scrape time.

``daemon`` is ``SERVING``, the daemon's own reason when it answers but does not serve
(``not serving: draining``), or ``unreachable: <why>``. The router's gRPC channel retries a
restarted daemon at most a second apart (``client.common.RECONNECT_BACKOFF_MS``), so the field
follows the daemon within about a second.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

from kvtierd.client import AsyncKVClient
from kvtierd.errors import KvtierError

UPSTREAM_TIMEOUT_S = 2.0  # vLLM's /health; a probe's own timeout is typically 1-5 s
DAEMON_TIMEOUT_S = 1.0
SERVING = "SERVING"
PROBE_PATHS = ("/livez", "/readyz")
"""Answered without the router's bearer token: the kubelet's HTTP probes send none, and they
tell no more than up or down."""


@dataclass(frozen=True, slots=True)
class Readiness:
    """What ``/readyz`` reports: ``upstream``, whether vLLM answers ``/health`` with 200
    (``upstream_detail``: why not); ``daemon``, the daemon's state (module docstring)."""

    upstream: bool
    upstream_detail: str
    daemon: str

    @property
    def ready(self) -> bool:
        return self.upstream

    @property
    def daemon_up(self) -> bool:
        return self.daemon == SERVING

    def body(self) -> dict[str, object]:
        out: dict[str, object] = {
            "status": "ready" if self.ready else "not ready",
            "upstream": self.upstream,
            "daemon": self.daemon,
        }
        if self.upstream_detail:
            out["upstream_error"] = self.upstream_detail
        return out


@dataclass(frozen=True, slots=True)
class RouterCounts:
    rewrites: int
    fallbacks: int
    lookup_errors: int


async def readiness(http: aiohttp.ClientSession, upstream: str, client: AsyncKVClient) -> Readiness:
    """vLLM's and the daemon's state, asked at once, each within its timeout."""
    (up, detail), daemon = await asyncio.gather(_upstream(http, upstream), _daemon(client))
    return Readiness(up, detail, daemon)


async def _upstream(http: aiohttp.ClientSession, upstream: str) -> tuple[bool, str]:
    timeout = aiohttp.ClientTimeout(total=UPSTREAM_TIMEOUT_S)
    try:
        async with http.get(f"{upstream}/health", timeout=timeout) as r:
            return (True, "") if r.status == 200 else (False, f"vLLM /health: HTTP {r.status}")
    except (aiohttp.ClientError, TimeoutError) as e:
        return False, f"vLLM at {upstream}: {type(e).__name__}: {e}"


async def _daemon(client: AsyncKVClient) -> str:
    try:
        status = await asyncio.wait_for(client.status(), DAEMON_TIMEOUT_S)
    except TimeoutError:
        return f"unreachable: no answer in {DAEMON_TIMEOUT_S:g} s"
    except KvtierError as e:
        return f"unreachable: {e}"
    return str(status.health)


def metrics_text(state: Readiness, counts: RouterCounts) -> str:
    """Prometheus' text format (0.0.4) of the router's state and counters."""
    series = [
        ("kvtierd_router_upstream_up", "gauge", "1 when vLLM answers /health", state.upstream),
        ("kvtierd_router_daemon_up", "gauge", "1 when the kvtierd daemon is SERVING",
         state.daemon_up),
        ("kvtierd_router_rewrites", "counter",
         "Requests served from a compressed context", counts.rewrites),
        ("kvtierd_router_fallbacks", "counter",
         "Rewritten requests vLLM failed, sent again as the real prompt", counts.fallbacks),
        ("kvtierd_router_lookup_errors", "counter",
         "Requests sent as they are because the daemon did not answer", counts.lookup_errors),
    ]  # fmt: skip
    lines = []
    for name, kind, help_text, value in series:
        sample = f"{name}_total" if kind == "counter" else name
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{sample} {int(value)}"]
    return "\n".join(lines) + "\n"
