"""Simulator: presets, calibration, determinism, trace loading, fair baselines, online
frequencies, headline and plots (small)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import ClassVar

import numpy as np
import pytest

from kvtierd.errors import InvalidArgumentError
from kvtierd.policies import PLACERS
from kvtierd.policies.lru import LruPlacer
from kvtierd.sim import SimulationConfig, headline, run_simulation, run_sweep
from kvtierd.sim.frontier import frontier, sweep_configs, ttft_at_quality
from kvtierd.sim.plots import plot_frontier
from kvtierd.sim.replay import RECOMPUTED, prepare, replay
from kvtierd.sim.timing import loaded_ttft_s, qps_at_ttft, queued_ttft_s
from kvtierd.sim.variant_space import VariantSpace, quant_ratio
from kvtierd.sim.workload import MODELS, WorkloadConfig
from kvtierd.types import ContextProfile, Plan, TierModel
from kvtierd.utility import LOAD_MARGIN, loaded_prefix

SMALL = SimulationConfig(workload=WorkloadConfig(n_contexts=60, n_requests=1500, seed=3))


def test_model_presets_match_the_paper():
    assert MODELS["llama-3.1-8b"].kv_bytes_per_token == 131072  # 0.125 MiB, §6.2: 0.12 GB/1K
    assert MODELS["qwen3-30b-a3b"].kv_bytes_per_token * 1000 / 2**30 == pytest.approx(0.0916, 1e-3)
    assert quant_ratio("int8") == 0.5625
    assert quant_ratio("int4") == 0.3125


def test_calibration_follows_section_4_2():
    prep = prepare(SMALL)
    names = prep.variants.names
    assert names[0] == "none" and len(names) == 1 + 27 + 2
    q = prep.variants.quality
    assert np.all(q[:, 0] == 1.0)
    # Quality falls monotonically with the kept ratio for each method.
    kd = [names.index(f"keydiff@{r:g}") for r in VariantSpace().ratios]
    assert np.all(np.diff(q[:, kd], axis=1) <= 1e-12)
    assert np.all(prep.variants.size_bytes[:, kd[-1]] < prep.variants.size_bytes[:, 0])


def test_same_seed_same_result_and_sweep_headline(tmp_path):
    a = run_simulation(SMALL)
    b = run_simulation(SMALL)
    assert a.summary() == b.summary()
    configs = sweep_configs(SMALL, (0.1, 1.0, 10.0), fixed_methods=("knorm",), fixed_ratios=(0.5,))
    sweep = run_sweep(SMALL, configs)
    assert [r.placer for r in sweep.oracle] == ["evicpress (oracle)"] * 3
    assert [r.placer for r in sweep.evicpress] == ["evicpress"] * 3
    qs, ts = frontier(sweep.evicpress)
    assert np.all(np.diff(qs) > 0) and np.all(np.diff(ts) > 0)
    assert ttft_at_quality((qs, ts), 2.0) is None
    for oracle in (False, True):
        rows = {r.baseline: r for r in headline(sweep, oracle=oracle)}
        assert set(rows) == {"fixed:knorm", "lru", "lfu", "prefill"}
        assert rows["prefill"].reduction_min is not None and rows["prefill"].reduction_min > 1.0
    assert plot_frontier(sweep, tmp_path / "f.png").stat().st_size > 1000


def test_queueing_grows_with_load():
    r = run_simulation(replace(SMALL, placer="lru"))
    a, s = r.arrival_s, r.service_s
    assert loaded_ttft_s(a, s, 0.01) == pytest.approx(r.ttft_mean_s, rel=0.05)
    assert loaded_ttft_s(a, s, 1.0 / r.ttft_mean_s) > 2 * r.ttft_mean_s
    qps = qps_at_ttft(a, s, 2 * r.ttft_mean_s)
    assert loaded_ttft_s(a, s, qps) <= 2 * r.ttft_mean_s + 1e-9


def test_fifo_queue_by_hand():
    """Arrivals 0, 1, 1.5 with 2 s of service each: waits 0, 1, 2.5; holding the engine 0.5 s
    after each first token (decoding) delays each later start by 0.5 s more."""
    a, s = np.array([0.0, 1.0, 1.5]), np.full(3, 2.0)
    assert queued_ttft_s(a, s).tolist() == [2.0, 3.0, 4.5]
    assert queued_ttft_s(a, s, hold_s=0.5).tolist() == [2.0, 3.5, 5.5]


SLOW = (
    TierModel("dram", int(2e9), 20e9, 0.0005),
    TierModel("remote", None, 1e8, 0.01),  # 0.1 GB/s: every load from here is slower than prefill
)


def test_a_load_slower_than_prefill_is_recomputed():
    """With the remote tier 10x slower than prefill, LRU's requests that find their context
    there are recomputed (full quality, prefill time), never loaded; without the rule they
    load, and every such request is slower than its prefill."""
    cfg = replace(SMALL, placer="lru", tiers=SLOW)
    fair = run_simulation(cfg)
    old = run_simulation(replace(cfg, recompute_slower_loads=False))
    assert fair.hit_rate["remote"] == 0.0 and fair.hit_rate["recompute"] > 0.3
    assert old.hit_rate["recompute"] == 0.0
    assert old.hit_rate["remote"] == pytest.approx(fair.hit_rate["recompute"])
    prep = prepare(cfg)
    wl = prep.workload
    ctx = wl.request_context[wl.measured]
    prefill = prep.prefill.seconds(
        (wl.context_tokens[ctx] + wl.query_tokens[wl.measured]).astype(float), np.zeros(ctx.size)
    )
    assert np.all(fair.service_s <= prefill + 1e-12)
    assert np.all(fair.service_s[fair.served == RECOMPUTED] == prefill[fair.served == RECOMPUTED])
    assert np.all(old.service_s[fair.served == RECOMPUTED] > prefill[fair.served == RECOMPUTED])
    assert fair.ttft_mean_s < old.ttft_mean_s and fair.served_as().count("recompute") > 0


def test_the_recompute_rule_is_the_daemons():
    """Issue 41: a request is recomputed exactly where the daemon's Lookup would recompute it
    (``utility.loaded_prefix`` on its load and the prefill that load saves, margin
    ``LOAD_MARGIN``), including loads faster than the prefill but not by the margin (a remote
    tier at 2 GB/s puts 100 of SMALL's requests there)."""
    tiers = (TierModel("dram", int(2e9), 20e9, 0.0005), TierModel("remote", None, 2e9, 0.01))
    cfg = replace(SMALL, placer="lru", tiers=tiers)
    fair = run_simulation(cfg)
    every = run_simulation(replace(cfg, recompute_slower_loads=False))  # every hit loads
    prep = prepare(cfg)
    wl = prep.workload
    ctx = wl.request_context[wl.measured]
    tokens = wl.context_tokens[ctx].astype(float)
    query = wl.query_tokens[wl.measured].astype(float)
    after = prep.prefill.seconds(query, tokens)  # LRU keeps originals: the query is left
    saved = prep.prefill.seconds(tokens + query, np.zeros_like(query)) - after
    load = every.service_s - after
    hit = every.served >= 0
    rule = loaded_prefix(load[:, None], saved[:, None]) == 0
    assert np.array_equal(fair.served[hit] == RECOMPUTED, rule[hit])
    in_margin = hit & (load < saved) & ((1 + LOAD_MARGIN) * load > saved)
    assert in_margin.sum() > 0 and np.all(fair.served[in_margin] == RECOMPUTED)


class _Recording(LruPlacer):
    """LRU that records the frequency of every profile it is given."""

    name = "recording"
    inserted: ClassVar[list[tuple[str, float]]] = []

    def insert(self, profile: ContextProfile) -> Plan:
        self.inserted.append((profile.context_id, profile.frequency))
        return super().insert(profile)


@pytest.fixture
def recording() -> Iterator[list[tuple[str, float]]]:
    _Recording.inserted = []
    with PLACERS.registered(_Recording):
        yield _Recording.inserted


def test_online_frequency_is_the_decayed_count_so_far(
    recording: list[tuple[str, float]],
) -> None:
    """Online, a context is inserted with the decayed count of its requests so far (1 at its
    first request); the oracle gives every insert the whole workload's expected count."""
    small = (TierModel("dram", int(20e9), 20e9), TierModel("ssd", int(40e9), 2e9))
    cfg = replace(SMALL, placer="recording", tiers=small, half_life_s=1e12)  # no decay
    prep = prepare(cfg)
    replay(cfg, prep)
    total = np.bincount(prep.workload.request_context, minlength=len(prep.profiles))
    last: dict[str, float] = {}
    for cid, exact in recording:  # counts of the requests so far: 1 first, then growing
        freq = round(exact)
        assert exact == pytest.approx(freq, abs=1e-6) and (cid in last or freq == 1)
        assert last.get(cid, 0.0) < freq <= total[int(cid[1:])]
        last[cid] = freq
    assert any(freq > 1 for _, freq in recording)  # evicted, asked again, re-inserted
    recording.clear()
    replay(replace(cfg, frequency="oracle"), prep)
    expected = {p.context_id: p.frequency for p in prep.profiles}
    assert all(freq == expected[cid] for cid, freq in recording)
    with pytest.raises(InvalidArgumentError, match="unknown frequency 'psychic'"):
        replace(SMALL, frequency="psychic")
