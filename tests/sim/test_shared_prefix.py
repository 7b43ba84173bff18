"""A shared prefix (one system prompt before every context, issue 29 item 5) in the simulator:
one more context every request needs, stored once, its loss a loss for every request. TTFTs
worked out by hand on tests/sim/test_predict.py's toy calibration and model (32 B of KV per
token; prefill 0.1 s + 1 ms per token; the cpu tier 0.05 s + 1 s per 320,000 B)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from kvtierd.errors import InvalidArgumentError
from kvtierd.sim import SimulationConfig, run_simulation
from kvtierd.sim.calibration import parse_calibration
from kvtierd.sim.given import calibrated_prepare, parse_workload
from kvtierd.sim.predict import predict
from kvtierd.sim.replay import PREFIX_ID, prepare, replay
from kvtierd.sim.workload import WorkloadConfig, make_workload
from tests.sim.test_predict import CALIBRATION, MODEL

LRU = SimulationConfig(placer="lru", warmup_fraction=0.0)


def doc(shared: int, capacity: int = 10**9, contexts: tuple[int, ...] = (1000, 2000)) -> Any:
    """c0 asked once to warm up, then c1, c0, c1 ten seconds apart, every query 10 tokens."""
    reqs = [(-10.0, 0, False), (0.0, 1, True), (10.0, 0, True), (20.0, 1, True)]
    out = {
        "model": MODEL,
        "tiers": [{"name": "cpu", "capacity_bytes": capacity}],
        "contexts": [{"tokens": n} for n in contexts],
        "requests": [{"index": k, "at_s": t, "context": c, "query_tokens": 10, "measured": m}
                     for k, (t, c, m) in enumerate(reqs)],
    }  # fmt: skip
    if shared:
        out["shared_prefix_tokens"] = shared
    return out


def served(shared: int, **kw: Any) -> tuple[list[str], list[float], dict[str, float]]:
    cal = parse_calibration(CALIBRATION, "cal.yaml", 32)
    p = predict(LRU, parse_workload(doc(shared, **kw), "w.json"), cal)
    return p.result.served_as(), p.result.service_s.tolist(), p.result.hit_rate


def test_without_a_prefix_nothing_changes() -> None:
    """c1's first request prefills 2,010 tokens; then loads of 32,000 and 64,000 B."""
    how, ttft, rates = served(0)
    assert how == ["miss", "cpu", "cpu"]
    assert ttft == pytest.approx([2.11, 0.26, 0.36])
    assert set(rates) == {"cpu", "recompute", "miss"}


def test_a_request_whose_document_misses_loads_the_shared_prefix() -> None:
    """500 shared tokens: c1's first request loads their bytes (16,000 B: 0.05 s; not the
    tier's 0.05 s overhead, which whole hits pay: replay._prefix_only) and prefills its own
    1,500 tokens and the query after them (0.1 + 1.51 s): 1.66 s, not 2.11. Both cached: the
    two loads share the tier's overhead, the same as loading the whole context."""
    how, ttft, rates = served(500)
    assert how == ["prefix", "cpu", "cpu"]
    assert ttft == pytest.approx([1.66, 0.26, 0.36])
    assert rates["prefix"] == pytest.approx(1 / 3)
    assert rates["shared_prefix_cached"] == 1.0  # every request needs it, all found it


def test_the_prefix_is_stored_once() -> None:
    """Room for 2,500 tokens (80,000 B): without a prefix c0 (1,000) and c1 (2,000) do not fit
    together and LRU evicts one for the other; with 500 shared tokens they do (500 + 500 +
    1,500): c1's second request is a hit instead of a miss."""
    how, _, _ = served(0, capacity=80_000)
    assert how == ["miss", "miss", "miss"]
    how, ttft, _ = served(500, capacity=80_000)
    assert how == ["prefix", "cpu", "cpu"] and ttft[2] == pytest.approx(0.36)


def test_a_document_behind_a_prefix_that_is_not_cached_is_no_hit() -> None:
    """A 900-token prefix (28,800 B) where the tier holds 25,600 B: never cached; the
    documents (100 and 200 own tokens) are, yet every request is prefilled in full."""
    cal = parse_calibration(CALIBRATION, "cal.yaml", 32)
    given = parse_workload(doc(900, 25_600, (1000, 1100)), "w.json")
    p = predict(LRU, given, cal)
    assert p.result.served_as() == ["miss"] * 3
    assert p.result.service_s.tolist() == pytest.approx([1.21, 1.11, 1.21])
    assert p.result.hit_rate["shared_prefix_cached"] == 0.0


def test_the_prefix_is_every_requests_context() -> None:
    """Its oracle frequency is the number of requests; it is kept whole; online, each request
    counts towards it as well as towards its own context."""
    cal = parse_calibration(CALIBRATION, "cal.yaml", 32)
    given = parse_workload(doc(500), "w.json")
    prep = calibrated_prepare(given, cal, ["none", "knorm@0.5"])
    assert prep.prefix is not None and prep.prefix.context_id == PREFIX_ID
    assert prep.prefix.frequency == 4.0 and [v.variant for v in prep.prefix.variants] == ["none"]
    assert prep.prefix.variants[0].size_bytes == 500 * 32
    # the documents' variants hold their own tokens only: c1's original 1,500 x 32 B
    assert prep.variants.size_bytes[1, 0] == 1500 * 32
    assert prep.profiles[1].prefill_s == pytest.approx(0.1 + 1.5)  # its own tokens
    assert calibrated_prepare(parse_workload(doc(0), "w.json"), cal, ["none"]).prefix is None


@pytest.mark.parametrize("bad", [-1, 1000, 1.5, True, "500"])
def test_a_prefix_that_is_not_below_every_context_is_refused(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="shared_prefix_tokens"):
        parse_workload(doc(0) | {"shared_prefix_tokens": bad}, "w.json")


def test_synthetic_workload_with_a_system_prompt() -> None:
    """The same documents with 2,048 shared tokens in front: every prefill is longer, the
    prefix is found cached by nearly every request, and the TTFTs differ."""
    base = WorkloadConfig(n_contexts=40, n_requests=800, seed=5)
    plain, shared = make_workload(base), make_workload(shared_config(base, 2048))
    # the same documents, those longer than the model's context less the prefix cut to fit
    longest = shared.model.max_context_tokens - 2048
    assert np.array_equal(shared.own_tokens, np.minimum(plain.context_tokens, longest))
    assert shared.context_tokens.max() <= shared.model.max_context_tokens
    assert np.array_equal(shared.request_context, plain.request_context)
    with_prefix = SimulationConfig(workload=shared_config(base, 2048), placer="prefill")
    without = SimulationConfig(workload=base, placer="prefill")
    assert run_simulation(with_prefix).ttft_mean_s > run_simulation(without).ttft_mean_s
    ep = SimulationConfig(workload=shared_config(base, 2048), placer="evicpress")
    result = run_simulation(ep)
    assert result.hit_rate["shared_prefix_cached"] > 0.95
    plain_ep = run_simulation(SimulationConfig(workload=base, placer="evicpress"))
    assert result.ttft_mean_s != plain_ep.ttft_mean_s
    done = replay(ep, prepare(ep))
    assert done.placer.placement(PREFIX_ID).tier is not None  # kept: every request needs it
    with pytest.raises(InvalidArgumentError, match=r"shared_prefix_tokens must be in \[0, "):
        make_workload(shared_config(base, 10**6))


def shared_config(base: WorkloadConfig, tokens: int) -> WorkloadConfig:
    return replace(base, shared_prefix_tokens=tokens)


def test_kvtierd_sim_run_takes_a_system_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtierd.sim.cli import main
    from tests.sim.test_cli import TINY

    assert main(["run", *TINY, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["run", *TINY, "--system-prompt-tokens", "4096", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert plain["config"]["system_prompt_tokens"] == 0
    assert doc["config"]["system_prompt_tokens"] == 4096
    (run,) = doc["runs"]
    assert run["hit_rate"]["shared_prefix_cached"] > 0.9
    assert sum(v for k, v in run["hit_rate"].items() if k != "shared_prefix_cached") == (
        pytest.approx(1.0)
    )  # every request one class: a tier, prefix, recompute or miss
    assert "shared_prefix_cached" not in plain["runs"][0]["hit_rate"]
    assert main(["run", *TINY, "--system-prompt-tokens", "-1"]) == 2
    assert "--system-prompt-tokens must be >= 0, got -1" in capsys.readouterr().err
    assert main(["run", *TINY, "--system-prompt-tokens", "200000"]) == 5
    assert "shared_prefix_tokens must be in [0, 130072]" in capsys.readouterr().err
