"""The load-or-recompute rule (issue 41): ``utility.loaded_prefix`` and the daemon's pricing of
a lookup's chunks (``engine/lookup_decision.py``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtierd.config import load_daemon_config
from kvtierd.engine.lookup_decision import LookupDecision, decide, restore_share
from kvtierd.engine.state import ObjectRecord
from kvtierd.errors import ConfigError
from kvtierd.types import ObjectMeta, TierModel
from kvtierd.utility import LOAD_MARGIN, loaded_prefix

MB = 1 << 20
FAST = TierModel("cpu", None, 10e9, 0.0001)  # 1 MiB in ~0.1 ms
SLOW = TierModel("remote", None, 10e6, 0.01)  # 1 MiB in ~0.1 s


def chunk(key: str, tier: str, tokens: int = 256, size: int = MB) -> ObjectRecord:
    return ObjectRecord(ObjectMeta(key, size, context_id="c", token_count=tokens), tier)


def test_whole_prefix_loads_when_it_wins_by_the_margin() -> None:
    # 1 s of load saves 1.2 s of prefill: within the 10 % margin, loaded
    assert loaded_prefix([1.0], [1.2]) == 1
    # 1 s saves 1.05 s: faster, but not by the margin: recomputed
    assert loaded_prefix([1.0], [1.05]) == 0
    assert loaded_prefix([1.0], [1.05], margin=0.0) == 1
    # exactly at the margin: a tie loads
    assert loaded_prefix([1.0], [1.0 + LOAD_MARGIN]) == 1


def test_split_loads_the_prefix_with_the_largest_gain() -> None:
    # three chunks: the first two cheap to load, the third slow (cumulative columns)
    load = [0.01, 0.02, 1.02]
    saved = [0.1, 0.2, 0.3]
    assert loaded_prefix(load, saved) == 2
    # rows are independent requests; one candidate per row is the simulator's whole context
    rows = loaded_prefix(np.array([[1.0], [0.1]]), np.array([[0.5], [0.5]]))
    assert rows.tolist() == [0, 1]


def test_unpriceable_side_never_wins_and_bad_input_is_refused() -> None:
    assert loaded_prefix([np.nan], [1.0]) == 0
    assert loaded_prefix([np.inf], [1.0]) == 0
    with pytest.raises(ValueError, match="margin"):
        loaded_prefix([1.0], [1.0], margin=-0.1)
    with pytest.raises(ValueError, match="one shape"):
        loaded_prefix([1.0, 2.0], [1.0])


def decided(
    found: list[ObjectRecord], tokens_per_s: float | None, mode: str = "decide"
) -> LookupDecision:
    return decide(found, (FAST, SLOW), restore_s=lambda rec: 0.0,
                  prefill_tokens_per_s=tokens_per_s, mode=mode)  # fmt: skip


def test_slow_tier_recomputes_fast_tier_loads_mixed_splits() -> None:
    # 256 tokens per chunk at 10k tokens/s: 25.6 ms of prefill per chunk
    fast = decided([chunk("a", "cpu"), chunk("b", "cpu")], 10_000.0)
    assert (fast.decision, fast.chunks) == ("load", 2)
    slow = decided([chunk("a", "remote"), chunk("b", "remote")], 10_000.0)
    assert (slow.decision, slow.chunks) == ("recompute", 0)
    assert "remote" in slow.reason and "tokens/s" in slow.reason
    mixed = decided([chunk("a", "cpu"), chunk("b", "cpu"), chunk("c", "remote")], 10_000.0)
    assert (mixed.decision, mixed.chunks) == ("split", 2)


def test_restore_cost_counts_towards_the_load() -> None:
    found = [chunk("a", "cpu")]
    cheap = decide(found, (FAST,), restore_s=lambda rec: 0.0, prefill_tokens_per_s=10_000.0)
    dear = decide(found, (FAST,), restore_s=lambda rec: 0.05, prefill_tokens_per_s=10_000.0)
    assert (cheap.decision, dear.decision) == ("load", "recompute")
    # a chunk's share of its context's profiled restore is by bytes; unprofiled: none
    assert restore_share(found[0], 4 * MB, 0.4) == pytest.approx(0.1)
    assert restore_share(found[0], 4 * MB, None) == 0.0


def test_unpriced_prefill_loads_and_modes_force() -> None:
    found = [chunk("a", "remote", tokens=0)]
    assert decided(found, 10_000.0).decision == "load"
    assert "tokens unknown" in decided(found, 10_000.0).reason
    slow = [chunk("a", "remote")]
    assert decided(slow, 10_000.0, mode="load").chunks == 1
    assert decided([chunk("a", "cpu")], 10_000.0, mode="recompute").chunks == 0
    assert decided([], 10_000.0).decision == ""


def test_config_names_the_allowed_decisions(tmp_path: Path) -> None:
    config = tmp_path / "kvtierd.yaml"
    config.write_text(
        f"socket_path: {tmp_path}/s.sock\ndata_dir: {tmp_path}\nlookup_decision: sometimes\n"
        "tiers: [{name: cpu, kind: cpu, capacity: 8MiB}]\n"
    )
    with pytest.raises(ConfigError, match="lookup_decision must be one of decide, load, recompute"):
        load_daemon_config(config)
    config.write_text(config.read_text().replace("sometimes", "load"))
    assert load_daemon_config(config).lookup_decision == "load"
