"""Several arrivals behind a miss (issue 30.4): vLLM prefills the requests waiting when it is
free in one step, so they get their first tokens together (``timing.batched_ttft_s``), within
its ``max_num_seqs`` and ``max_num_batched_tokens`` (a calibration's ``batch``)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtierd.errors import InvalidArgumentError
from kvtierd.sim.calibration import parse_calibration
from kvtierd.sim.timing import Batching, batched_ttft_s, queued_ttft_s

# a 2-second miss at 0, then three 0.3-second hits of 100 new tokens each behind it
ARRIVAL = np.array([0.0, 0.1, 0.2, 0.3])
SERVICE = np.array([2.0, 0.3, 0.3, 0.3])
TOKENS = np.array([1000.0, 100.0, 100.0, 100.0])


def test_one_at_a_time_is_first_come_first_served() -> None:
    rng = np.random.default_rng(0)
    arrival = np.sort(rng.uniform(0, 20, 50))
    service = rng.uniform(0.1, 2.0, 50)
    for hold in (0.0, 0.4):
        got = batched_ttft_s(arrival, service, np.full(50, 100.0), Batching(), hold)
        assert np.allclose(got, queued_ttft_s(arrival, service, hold))
    fifo = batched_ttft_s(ARRIVAL, SERVICE, TOKENS, Batching())
    assert fifo == pytest.approx([2.0, 2.2, 2.4, 2.6])


def test_the_arrivals_behind_a_miss_are_prefilled_together() -> None:
    got = batched_ttft_s(ARRIVAL, SERVICE, TOKENS, Batching(max_seqs=8, max_tokens=8192))
    assert got == pytest.approx([2.0, 2.8, 2.7, 2.6])  # all three at 2.9 s
    # 250 tokens per step: two of them, then the third
    got = batched_ttft_s(ARRIVAL, SERVICE, TOKENS, Batching(max_seqs=8, max_tokens=250))
    assert got == pytest.approx([2.0, 2.5, 2.4, 2.6])
    got = batched_ttft_s(ARRIVAL, SERVICE, TOKENS, Batching(max_seqs=2))
    assert got == pytest.approx([2.0, 2.5, 2.4, 2.6])


def test_a_calibration_says_how_vllm_batches() -> None:
    text = """\
prefill: {overhead_s: 0.1, seconds_per_token: 0.001}
batch: {max_seqs: 8, max_tokens: 8192}
tiers: [{name: cpu, overhead_s: 0.05, bandwidth_bytes_per_s: 320000}]
"""
    assert parse_calibration(text, "c.yaml", 32).batching == Batching(8, 8192.0)
    no_batch = text.replace("batch: {max_seqs: 8, max_tokens: 8192}\n", "")
    assert parse_calibration(no_batch, "c.yaml", 32).batching == Batching()
    with pytest.raises(InvalidArgumentError, match=r"c.yaml: batch.max_seqs: expected an integer"):
        parse_calibration(text.replace("max_seqs: 8", "max_seqs: 0"), "c.yaml", 32)
    with pytest.raises(InvalidArgumentError, match="unknown key 'seqs'"):
        parse_calibration(text.replace("max_seqs", "seqs"), "c.yaml", 32)
