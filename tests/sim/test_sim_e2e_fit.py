"""What ``benchmarks/e2e/sim_e2e.py`` takes from a measured bench_e2e run (issue 30.4): the KV dtype
the cached systems kept, their own prefill line, the decode hold, quantized hits for the load
model, LMCache's inclusive tiers, the fixed systems' measured quality and what the EvicPress
daemon's estimator profiled."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.e2e.e2e_calibration import (
    Lengths,
    Service,
    fit_calibrations,
    fit_decode_s,
    miss_samples,
    prefill_samples,
    quantized_hits,
    vllm_batching,
)
from benchmarks.e2e.e2e_measured import (
    estimator_profiles,
    inclusive,
    kv_dtype_bytes,
    measured_quality,
)
from benchmarks.e2e.sim_e2e import compare, disagreements
from kvtierd.sim.calibration import parse_calibration
from kvtierd.sim.given import parse_workload
from kvtierd.sim.predict import predict
from kvtierd.sim.replay import SimulationConfig
from kvtierd.sim.timing import Batching, LinearPrefill, queued_ttft_s
from tests.sim.test_predict import CALIBRATION, workload

# Two contexts (768 and 1,792 tokens), each asked once to warm up, then three timed requests.
DOC: dict[str, Any] = {
    "model": {"name": "toy", "layers": 1, "q_heads": 1, "kv_heads": 1, "head_dim": 8,
              "active_params": 1e6, "max_context_tokens": 8192, "dtype_bytes": 4},
    "tiers": [{"name": "cpu", "capacity_bytes": 100}, {"name": "ssd", "capacity_bytes": 300}],
    "contexts": [{"tokens": 768}, {"tokens": 1792}],
    "requests": [
        {"index": -1, "at_s": -2.0, "context": 0, "question": 0, "query_tokens": 20,
         "measured": False},
        {"index": -2, "at_s": -1.0, "context": 1, "question": 0, "query_tokens": 20,
         "measured": False},
        {"index": 0, "at_s": 0.0, "context": 0, "question": 1, "query_tokens": 30},
        {"index": 1, "at_s": 10.0, "context": 1, "question": 0, "query_tokens": 20},
        {"index": 2, "at_s": 20.0, "context": 0, "question": 0, "query_tokens": 20},
    ],
}  # fmt: skip


def outcome(index: int, context: int, question: int, sent: float, ttft: float, *,
            cached: int = 0, decode: float = 3.0) -> dict[str, Any]:  # fmt: skip
    """One of bench_e2e's outcomes (``e2e_workload.Outcome`` as JSON)."""
    return {"index": index, "context": context, "question": question, "sent_s": sent,
            "ttft_s": ttft, "total_s": ttft + decode, "answer": "x", "served_from": "",
            "error": "", "cached_tokens": cached}  # fmt: skip


# bench_e2e records the warm-up (since issue 26) without question or error
WARMUP = [{"context": 0, "sent_unix_s": 1.0, "ttft_s": 2.0, "total_s": 3.0},
          {"context": 1, "sent_unix_s": 5.0, "ttft_s": 4.0, "total_s": 5.0}]  # fmt: skip


def test_the_warm_up_as_bench_e2e_records_it_now() -> None:
    run = {"warmup": WARMUP, "outcomes": [outcome(0, 0, 1, 0.0, 1.0)]}
    got = prefill_samples(run, Lengths(DOC))
    assert got[:2] == [Service(768, 20, 2.0), Service(1792, 20, 4.0)]


def test_cached_systems_prefill_from_their_own_misses() -> None:
    # the warm-ups (a run starts empty) and the timed request vLLM found nothing of; not the
    # hit (1,792 cached tokens) nor the one served from a variant
    outs = [outcome(0, 0, 1, 0.0, 1.5), outcome(1, 1, 0, 10.0, 0.3, cached=1792),
            outcome(2, 0, 0, 20.0, 0.2) | {"served_from": "x/keydiff@0.5"}]  # fmt: skip
    got = miss_samples([{"warmup": WARMUP, "outcomes": outs}], Lengths(DOC))
    assert got == [Service(768, 20, 2.0), Service(1792, 20, 4.0), Service(768, 30, 1.5)]
    # behind a shared prefix only a run's first request computed its whole prompt
    shared = Lengths(DOC | {"shared_prefix_tokens": 256})
    assert miss_samples([{"warmup": WARMUP, "outcomes": outs}], shared)[:2] == [
        Service(768, 20, 2.0),
        Service(768, 30, 1.5),
    ]


def test_behind_a_shared_prefix_the_cached_line_is_their_own_first_miss(tmp_path: Path) -> None:
    # Behind a shared prefix every cached request after a run's first finds the prefix: the
    # cached systems' misses are their first warm-ups, at one length. Their vLLM (float32 on
    # an AMX CPU) is not the prefill system's (bfloat16): the line goes through those misses
    # and the origin, not through the prefill system's requests (seed1-sp1024 of issue 30's
    # matrix: 0.64 ms a token from the prefill system where the cached systems' first misses
    # took 1.28 ms, so LMCache's misses behind the prefix were predicted at 0.39x)
    doc = DOC | {"shared_prefix_tokens": 256}
    fast = [w | {"ttft_s": w["ttft_s"] / 2} for w in WARMUP]
    reference = {"warmup": fast, "outcomes": [outcome(0, 0, 1, 0.0, 0.5),
                                              outcome(1, 1, 0, 10.0, 1.0),
                                              outcome(2, 0, 0, 20.0, 0.4)]}  # fmt: skip
    hits = [outcome(0, 0, 1, 0.0, 0.3, cached=768), outcome(1, 1, 0, 10.0, 0.4, cached=1792),
            outcome(2, 0, 0, 20.0, 0.3, cached=768)]  # fmt: skip
    (tmp_path / "prefill.json").write_text(json.dumps(reference))
    (tmp_path / "lru.json").write_text(json.dumps({"warmup": WARMUP, "outcomes": hits}))
    cal = fit_calibrations(tmp_path, doc, kv_per_token=1000)["kvtierd"]
    assert cal.prefill.overhead_s == 0.0
    assert cal.prefill.seconds_per_token == pytest.approx(2.0 / (768 + 20))


def test_the_decode_hold_is_fitted_to_the_prefill_system() -> None:
    line = LinearPrefill(seconds_per_token=0.001)  # 788 tokens: 0.788 s
    sent = np.array([0.0, 0.9, 1.8])
    service = np.full(3, 0.788)
    for hold in (0.0, 0.5):
        ttft = queued_ttft_s(sent, service, hold)
        pairs = enumerate(zip(sent.tolist(), ttft.tolist(), strict=True))
        outs = [outcome(i, 0, 0, s, t) for i, (s, t) in pairs]
        assert fit_decode_s({"outcomes": outs}, Lengths(DOC), line, Batching()) == pytest.approx(
            hold
        )


def test_quantized_hits_are_priced_at_their_bytes(tmp_path: Path) -> None:
    hit = outcome(0, 0, 1, 0.0, 0.3, cached=768)
    miss = outcome(1, 1, 0, 10.0, 2.0)
    for name in ("fixed-int8", "fixed-keydiff@0.5"):  # the token-dropped one is not taken
        (tmp_path / f"{name}.json").write_text(json.dumps({"outcomes": [hit, miss]}))
    # int8 of float32 KV: 0.5625 / 2 of the bytes
    assert quantized_hits(tmp_path, Lengths(DOC), DOC) == [Service(216, 30, 0.3)]


def test_the_kv_dtype_is_the_measured_vllms(tmp_path: Path) -> None:
    log = tmp_path / "work" / "lru" / "vllm.log"
    log.parent.mkdir(parents=True)
    log.write_text("LMCacheMetadata(model_name='m', kv_dtype=torch.float32, kv_shape=(30,))\n")
    assert kv_dtype_bytes(tmp_path, tmp_path / "no-model") == 4
    log.write_text("kv_dtype=torch.bfloat16\n")
    assert kv_dtype_bytes(tmp_path, tmp_path / "no-model") == 2


def test_lmcache_alone_holds_its_cpu_chunks_on_disk_too() -> None:
    given = inclusive(parse_workload(DOC, "w.json"))
    assert dict(given.capacity_bytes) == {"cpu": 100, "ssd": 200}
    small = DOC | {"tiers": [{"name": "cpu", "capacity_bytes": 300},
                             {"name": "ssd", "capacity_bytes": 100}]}  # fmt: skip
    assert dict(inclusive(parse_workload(small, "w.json")).capacity_bytes)["ssd"] == 0


def test_a_fixed_systems_measured_similarity_is_its_variants_quality(tmp_path: Path) -> None:
    rows = {"lru": {"similarity": 0.99}, "fixed-int8": {"similarity": 0.985},
            "fixed-keydiff@0.5+int8": {"similarity": 0.93}}  # fmt: skip
    (tmp_path / "summary.json").write_text(json.dumps(rows))
    assert measured_quality(tmp_path) == {"int8": 0.985, "keydiff@0.5+int8": 0.93}
    assert measured_quality(tmp_path / "none") == {}


def test_the_estimators_profiles_are_taken_per_context_length(tmp_path: Path) -> None:
    profiles = tmp_path / "work" / "evicpress-a2" / "daemon" / "data" / "profiler" / "profiles"
    profiles.mkdir(parents=True)
    for name, tokens, int4 in (("a", 768, 0.91), ("b", 768, 0.93), ("c", 1792, 0.8)):
        variants = [
            {"variant": "none", "quality": 1.0, "size_bytes": 1, "restore_s": 0.0},
            {"variant": "int4", "quality": int4, "size_bytes": 1, "restore_s": 0.0},
        ]
        doc = {"context_id": name, "num_tokens": tokens, "variants": variants}  # fmt: skip
        (profiles / f"{name}.json").write_text(json.dumps(doc))
    got = estimator_profiles(tmp_path)
    assert got == {
        768: {"none": 1.0, "int4": pytest.approx(0.92)},
        1792: {"none": 1.0, "int4": 0.8},
    }
    assert estimator_profiles(tmp_path / "none") == {}


def test_the_batching_is_the_measured_vllms(tmp_path: Path) -> None:
    assert vllm_batching(tmp_path) is None
    log = tmp_path / "work" / "prefill" / "vllm.log"
    log.parent.mkdir(parents=True)
    log.write_text("non-default args: {'max_num_batched_tokens': 8192, 'max_num_seqs': 8}\n")
    assert vllm_batching(tmp_path) == {"max_seqs": 8, "max_tokens": 8192}


def test_the_comparison_names_the_requests_where_loading_disagrees() -> None:
    doc = workload()
    for r in doc["requests"]:
        r["question"] = 0
    given = parse_workload(doc, "w.json")
    cal = parse_calibration(CALIBRATION, "c.yaml", 32)
    pred = predict(SimulationConfig(placer="lru", warmup_fraction=0.0), given, cal)
    assert pred.result.served_as() == ["cpu", "cpu", "cpu"]  # both contexts warmed up
    timed = [r for r in doc["requests"] if r["measured"]]
    measured = {"outcomes": [outcome(r["index"], r["context"], 0, r["at_s"], 0.5) for r in timed]}
    got = compare(pred, measured, doc, hits={2: True, 3: False, 4: True})
    assert got["hits"] == {"predicted": 3, "measured": 2}
    assert got["disagree"] == {
        "predicted_loaded": [{"index": 3, "context": 1, "predicted": "cpu", "ttft_s": 0.5}],
        "measured_loaded": [],
    }
    lines = disagreements({"lru": {"comparison": got}})
    assert lines[-1] == "- lru: predicted loaded, measured computed: 1 requests: 3 (c1, 0.50 s)"
    assert compare(pred, measured, doc)["disagree"] == {"predicted_loaded": [],
                                                       "measured_loaded": []}  # fmt: skip


def test_kvtierd_systems_are_simulated_with_the_plugins_lookup_hold() -> None:
    # the daemon defers drops of what a lookup found (kvtierd/sim/executing.py); LMCache alone
    # has no daemon, so nothing holds its contexts
    from benchmarks.e2e.bench_e2e import systems
    from benchmarks.e2e.sim_e2e import HOLD_S, placer_for

    every = systems([2.0], ["int8"], Path("model"), ["keydiff"], [1.0, 0.5])
    held = {name: placer_for(name, s.policy)[0].hold_s for name, s in every.items()}
    assert HOLD_S == 30.0
    assert held == {"prefill": 0.0, "lmcache": 0.0, "lru": HOLD_S, "fixed-int8": HOLD_S,
                    "evicpress-a2": HOLD_S, "evicpress-prior-a2": HOLD_S}  # fmt: skip
