"""benchmarks/e2e/e2e_calibration.py: service times from an open-loop run, hits from vLLM's log
(LMCache's own lines), and the calibration file they make, fitted by ``kvtierd sim``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.e2e.e2e_calibration import (
    Lengths,
    Service,
    calibration_yaml,
    hit_samples,
    logged_hits,
    measured_hits,
    prefill_samples,
    ran_alone,
    service_times,
)
from kvtierd.sim.calibration import parse_calibration

# Two contexts (768 and 1,792 tokens), question 0 of each 20 tokens, question 1 of c0 30.
DOC = {
    "contexts": [{"tokens": 768}, {"tokens": 1792}],
    "requests": [
        {"index": -1, "context": 0, "question": 0, "query_tokens": 20, "measured": False},
        {"index": -2, "context": 1, "question": 0, "query_tokens": 20, "measured": False},
        {"index": 0, "context": 0, "question": 1, "query_tokens": 30},
        {"index": 1, "context": 1, "question": 0, "query_tokens": 20},
        {"index": 2, "context": 0, "question": 0, "query_tokens": 20},
    ],
}


def outcome(index: int, context: int, question: int, sent: float, ttft: float) -> dict[str, Any]:
    """One of bench_e2e's outcomes (``e2e_workload.Outcome`` as JSON)."""
    return {"index": index, "context": context, "question": question, "sent_s": sent,
            "ttft_s": ttft, "total_s": ttft + 3.0, "answer": "x", "served_from": "",
            "error": ""}  # fmt: skip


# Request 0 runs alone (1.0 s); 1 is sent at 2.0 and has its first token at 5.0; 2 is sent at
# 2.5, while 1 is prefilling, and has its first token at 5.5: its service is 5.5 - 5.0.
RUN = {"outcomes": [outcome(0, 0, 1, 0.0, 1.0), outcome(1, 1, 0, 2.0, 3.0),
                    outcome(2, 0, 0, 2.5, 3.0)]}  # fmt: skip

LOG_LINE = (
    "\x1b[32;20m[2026-11-23 12:53:32,808] LMCache INFO:\x1b[0m Reqid: cmpl-{id}, Total tokens "
    "{total}, Inference Engine computed tokens: 0, LMCache hit tokens: {hit}, need to load: "
    "{hit} \x1b[3m(vllm_v1_adapter.py:1476:lmcache.integration.vllm.vllm_v1_adapter)\x1b[0m"
)


def log(tmp_path: Path, rows: list[tuple[str, int, int]]) -> Path:
    path = tmp_path / "vllm.log"
    lines = ["(APIServer pid=1) INFO 11-23 12:53:30 [loggers.py:335] Engine 000: Avg prompt"]
    lines += [LOG_LINE.format(id=i, total=t, hit=h) for i, t, h in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_service_times_split_the_busy_engine_in_first_token_order() -> None:
    assert service_times(RUN["outcomes"]) == {0: 1.0, 1: 3.0, 2: 0.5}
    failed = [*RUN["outcomes"][:2], RUN["outcomes"][2] | {"error": "HTTP 500"}]
    assert service_times(failed) == {0: 1.0, 1: 3.0}


def test_prefill_samples_take_the_warm_up_as_measured() -> None:
    warm = {"warmup": [outcome(0, 1, 0, 0.0, 2.5)]}
    got = prefill_samples(RUN | warm, Lengths(DOC))
    assert got == [Service(1792, 20, 2.5), Service(768, 30, 1.0), Service(1792, 20, 3.0),
                   Service(768, 20, 0.5)]  # fmt: skip


def test_a_fit_takes_the_requests_that_ran_alone_as_measured() -> None:
    # 0 and 1 ran alone (nothing else in flight from sending to first token); 2 was sent while
    # 1 was decoding its answer: an overloaded run's estimate of its service is unreliable.
    alone = {"outcomes": [outcome(0, 0, 1, 0.0, 1.0), outcome(1, 1, 0, 10.0, 3.0),
                          outcome(2, 0, 0, 14.0, 9.0)]}  # fmt: skip
    assert ran_alone(alone["outcomes"]) == {0, 1}
    assert prefill_samples(alone, Lengths(DOC)) == [Service(768, 30, 1.0), Service(1792, 20, 3.0)]
    # Another system's misses time the prefill too; its hits (context cached) do not.
    other = {"outcomes": [outcome(0, 0, 1, 0.0, 1.2) | {"cached_tokens": 0},
                          outcome(1, 1, 0, 10.0, 0.4) | {"cached_tokens": 1792}]}  # fmt: skip
    got = prefill_samples(alone, Lengths(DOC), [other])
    assert got == [Service(768, 30, 1.0), Service(1792, 20, 3.0), Service(768, 30, 1.2)]
    loaded = hit_samples(other, Lengths(DOC), {0: False, 1: True})
    assert [s.row() for s in loaded] == [[1792, 0.4, 20]]  # one length: the estimate (as run)


def test_hits_come_from_lmcache_lines_matched_by_prompt_length(tmp_path: Path) -> None:
    # warm-up c0 q0 (788), c1 q0 (1812); then the timed requests in sending order; request 1
    # is logged twice (rescheduled): its first line counts.
    rows = [("a", 788, 0), ("b", 1812, 0), ("c", 798, 768), ("d", 1812, 1536), ("d", 1812, 0),
            ("e", 788, 512)]  # fmt: skip
    path = log(tmp_path, rows)
    assert logged_hits(path) == [(788, 0), (1812, 0), (798, 768), (1812, 1536), (788, 512)]
    hits = measured_hits(RUN, Lengths(DOC), path)
    assert hits == {0: True, 1: False, 2: False}  # 1 and 2 loaded part of their context only
    assert hit_samples(RUN, Lengths(DOC), {0: True, 1: True, 2: False}) == [
        Service(768, 30, 1.0),
        Service(1792, 20, 3.0),
    ]
    assert measured_hits(RUN, Lengths(DOC), tmp_path / "missing.log") is None
    assert measured_hits(RUN, Lengths(DOC), log(tmp_path, rows[:3])) is None  # too few lines


def test_vllm_usage_in_the_outcomes_says_the_hits_without_a_log(tmp_path: Path) -> None:
    # bench_e2e since issue 13.3: prompt_tokens and cached_tokens per outcome
    cached = [768, 1024, 0]  # c0 whole, c1 (1,792 tokens) in part, a miss
    run = {"outcomes": [o | {"prompt_tokens": 800, "cached_tokens": c}
                        for o, c in zip(RUN["outcomes"], cached, strict=True)]}  # fmt: skip
    assert measured_hits(run, Lengths(DOC), tmp_path / "no.log") == {0: True, 1: False, 2: False}
    variant = {"outcomes": [run["outcomes"][0], run["outcomes"][1] | {"served_from": "d/knorm@0.5"},
                            run["outcomes"][2]]}  # fmt: skip
    assert measured_hits(variant, Lengths(DOC), tmp_path / "no.log") == {0: True, 1: True, 2: False}
    unknown = {"outcomes": [o | {"cached_tokens": -1} for o in run["outcomes"]]}
    assert measured_hits(unknown, Lengths(DOC), tmp_path / "no.log") is None


def test_the_calibration_file_fits_in_kvtierd_sim() -> None:
    prefill = [Service(768, 20, 1.0), Service(1792, 20, 2.024), Service(768, 40, 1.02)]
    hits = [Service(768, 20, 0.35), Service(1792, 20, 0.45)]
    text = calibration_yaml(prefill, hits, ["cpu", "ssd"], "run.json")
    cal = parse_calibration(text, "c.yaml", kv_bytes_per_token=1000)
    # prefill: 0.212 s + 1 ms per token (788 -> 1.0 s, 1812 -> 2.024 s, 808 -> 1.02 s)
    assert cal.prefill.seconds_per_token == pytest.approx(1e-3)
    assert cal.prefill.overhead_s == pytest.approx(0.212)
    # a hit less its query's prefill (0.232 s): 0.118 s at 768 kB, 0.218 s at 1,792 kB
    cpu, ssd = cal.tiers
    assert (cpu.name, ssd.name) == ("cpu", "ssd")
    assert cpu.load_bandwidth_bytes_per_s == ssd.load_bandwidth_bytes_per_s
    assert cpu.load_bandwidth_bytes_per_s == pytest.approx(1.024e7)
    assert cpu.load_overhead_s == pytest.approx(0.118 - 768_000 / 1.024e7)
    one_length = calibration_yaml(prefill, hits[:1], ["cpu"], "run.json")
    cal = parse_calibration(one_length, "c.yaml", kv_bytes_per_token=1000)
    assert cal.tiers[0].load_overhead_s == 0.0  # one length: bytes / bandwidth only
    assert cal.tiers[0].load_bandwidth_bytes_per_s == pytest.approx(768_000 / 0.118)
    # misses at one length cannot tell an overhead from the slope either: through the origin
    one_length = calibration_yaml(prefill[:1], hits, ["cpu"], "run.json")
    cal = parse_calibration(one_length, "c.yaml", kv_bytes_per_token=1000)
    assert cal.prefill.overhead_s == 0.0
    assert cal.prefill.seconds_per_token == pytest.approx(1.0 / 788)
