"""Load or recompute at the daemon's Lookup (issue 41): a hit in a tier slower than prefilling
its tokens is reported as recompute, a fast tier's as load, a lookup across both as split,
each counted in ``kvtierd_lookup_decisions``.

The daemon loads at its tiers' given bandwidths (``tests/given_bandwidths.py``): CPU arena
8.3 GB/s, SSD 0.55 GB/s + 0.54 ms, so the slow tier is slow by configuration, whatever the
machine does. 4 MiB chunks of 256 tokens, prefill 256 tokens in 2.5 ms: a CPU chunk loads in
~0.5 ms (load), an SSD chunk in ~8.7 ms (recompute).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from benchmarks._support.daemon_proc import DaemonProcess, lookup_decisions
from kvtierd.client import KVClient

CHUNK_BYTES = 4 << 20
TOKENS = 256


def put_chunks(c: KVClient, context: str, n: int) -> list[str]:
    keys = [f"{context}/{i}" for i in range(n)]
    for i, key in enumerate(keys):
        c.put(key, np.full(CHUNK_BYTES, i, np.uint8), context_id=context, token_count=TOKENS)
    return keys


def test_slow_tier_hit_recomputed_fast_tier_hit_loaded(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon(cpu="64MiB", ssd="64MiB", prefill_tokens_per_s=TOKENS / 2.5e-3,
                     metrics_port="any")  # fmt: skip
    with KVClient(d.socket_path) as c:
        slow = put_chunks(c, "slow", 2)
        assert c.drain("cpu").moved == 1
        fast = put_chunks(c, "fast", 2)
        assert c.lookup(slow).tiers == ("ssd", "ssd")
        assert c.lookup(fast).tiers == ("cpu", "cpu")

        on_ssd = c.lookup(slow, decide=True)
        assert (on_ssd.prefix_hits, on_ssd.load_chunks, on_ssd.decision) == (2, 0, "recompute")
        assert "ssd" in on_ssd.reason and "tokens/s" in on_ssd.reason
        in_cpu = c.lookup(fast, decide=True)
        assert (in_cpu.prefix_hits, in_cpu.load_chunks, in_cpu.decision) == (2, 2, "load")
        both = c.lookup([*fast, *slow], decide=True)
        assert (both.prefix_hits, both.load_chunks, both.decision) == (4, 2, "split")
        # without decide (every other caller): the found prefix, as before
        plain = c.lookup(slow)
        assert (plain.load_chunks, plain.decision) == (2, "")
        nothing = c.lookup(["absent"], decide=True)
        assert (nothing.prefix_hits, nothing.load_chunks, nothing.decision) == (0, 0, "")
    assert lookup_decisions(d) == {"load": 1.0, "recompute": 1.0, "split": 1.0}
