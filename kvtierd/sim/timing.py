"""How long a request takes: prefill models and queueing on one LLM server (vLLM).

Two prefill models, one interface (seconds to prefill ``new`` tokens after ``past`` ones):

* :class:`RooflinePrefill` — the paper-scale model: ``2 * active_params`` FLOPs per token plus
  attention ``4 * layers * q_heads * head_dim`` FLOPs per token pair, at ``flops`` (default H100
  bf16 dense 989 TFLOP/s x 40% utilisation);
* :class:`LinearPrefill` — a measured LLM server (:mod:`kvtierd.sim.calibration`): a fixed
  ``overhead_s`` per request plus ``seconds_per_token`` per new token. It charges the overhead
  to every request, hit or miss (a hit still goes through the server's scheduler and prefills
  its query), so a hit's TTFT is ``overhead_s + seconds_per_token * query + tier load``.

The unloaded TTFT of a request is its service time; :func:`queued_ttft_s` adds waiting on one
LLM server that serves requests first come, first served (with ``hold_s`` seconds of decoding after
each first token before the next request starts); :func:`batched_ttft_s` has it prefill the
requests waiting together, as vLLM's scheduler does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvtierd.errors import InvalidArgumentError
from kvtierd.policies.model import FloatArray
from kvtierd.sim.workload import ModelPreset

H100_BF16_FLOPS = 989e12
"""Dense bf16 peak of one H100 SXM (FLOP/s)."""


class PrefillModel(Protocol):
    def seconds(self, new_tokens: FloatArray, past_tokens: FloatArray) -> FloatArray:
        """Seconds to prefill ``new_tokens`` after ``past_tokens`` cached ones (same shapes)."""
        ...


@dataclass(frozen=True, slots=True)
class RooflinePrefill:
    """Compute-bound prefill of ``model`` at ``flops`` FLOP/s (module docstring)."""

    model: ModelPreset
    flops: float = H100_BF16_FLOPS * 0.4

    def seconds(self, new_tokens: FloatArray, past_tokens: FloatArray) -> FloatArray:
        m = self.model
        linear = 2.0 * m.active_params * new_tokens
        attention = 4.0 * m.layers * m.q_heads * m.head_dim * new_tokens
        out: FloatArray = (linear + attention * (past_tokens + new_tokens / 2.0)) / self.flops
        return out


@dataclass(frozen=True, slots=True)
class LinearPrefill:
    """A measured LLM server: ``overhead_s + seconds_per_token * new_tokens`` (module docstring).

    The attention term's growth with ``past_tokens`` is inside the fitted slope at the
    lengths measured; small models on CPUs are dominated by the linear layers.
    """

    seconds_per_token: float
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.seconds_per_token > 0 or self.overhead_s < 0:
            raise InvalidArgumentError(
                f"prefill needs seconds_per_token > 0 and overhead_s >= 0, got "
                f"{self.seconds_per_token}, {self.overhead_s}"
            )

    def seconds(self, new_tokens: FloatArray, past_tokens: FloatArray) -> FloatArray:
        out: FloatArray = self.overhead_s + self.seconds_per_token * new_tokens
        return out


def queued_ttft_s(arrival_s: FloatArray, service_s: FloatArray, hold_s: float = 0.0) -> FloatArray:
    """Per request: waiting + service on one LLM server serving in arrival order (``arrival_s``
    ascending). After its first token a request holds the server ``hold_s`` more seconds."""
    out = np.empty_like(service_s)
    free = -np.inf
    for k, (a, s) in enumerate(zip(arrival_s.tolist(), service_s.tolist(), strict=True)):
        start = max(free, a)
        out[k] = start + s - a
        free = start + s + hold_s
    return out


@dataclass(frozen=True, slots=True)
class Batching:
    """How many waiting requests the LLM server prefills in one step: at most ``max_seqs``
    prompts and ``max_tokens`` new tokens (vLLM's ``max_num_seqs`` and
    ``max_num_batched_tokens``). The default, one at a time, is first come, first served."""

    max_seqs: int = 1
    max_tokens: float = float("inf")

    def __post_init__(self) -> None:
        if isinstance(self.max_seqs, bool) or not (
            isinstance(self.max_seqs, int) and self.max_seqs >= 1
        ):
            raise InvalidArgumentError(
                f"batch max_seqs must be an integer >= 1, got {self.max_seqs!r}"
            )
        if not self.max_tokens > 0:
            raise InvalidArgumentError(f"batch max_tokens must be > 0, got {self.max_tokens!r}")


def batched_ttft_s(
    arrival_s: FloatArray,
    service_s: FloatArray,
    new_tokens: FloatArray,
    batching: Batching,
    hold_s: float = 0.0,
) -> FloatArray:
    """Per request: waiting + service on one LLM server that, whenever it is free, prefills the
    requests waiting then in one step (in arrival order, within ``batching``; the first always):
    the step takes what its requests take one at a time (a CPU's prefill is compute-bound) and
    they all get their first token at its end — several arrivals behind a long miss wait for
    each other, as vLLM's scheduler has them (issue 26's loaded run: four requests queued behind
    a miss had their first tokens at the same instant). Then ``hold_s`` as
    :func:`queued_ttft_s`; with the default :class:`Batching` the two are the same."""
    arrival, service, tokens = arrival_s.tolist(), service_s.tolist(), new_tokens.tolist()
    out = np.empty_like(service_s)
    free, k, n = -np.inf, 0, len(arrival)
    while k < n:
        start = max(free, arrival[k])
        j, taken = k + 1, tokens[k]
        while (j < n and j - k < batching.max_seqs and arrival[j] <= start
               and taken + tokens[j] <= batching.max_tokens):  # fmt: skip
            taken += tokens[j]
            j += 1
        end = start + sum(service[k:j])
        out[k:j] = end - arrival_s[k:j]
        free, k = end + hold_s, j
    return out


def loaded_ttft_s(arrival_s: FloatArray, service_s: FloatArray, qps: float) -> float:
    """Mean TTFT (s) with queueing when the arrival pattern is stretched or compressed to a
    mean rate of ``qps`` requests per second."""
    base_qps = (arrival_s.size - 1) / max(float(arrival_s[-1] - arrival_s[0]), 1e-9)
    times = (arrival_s - arrival_s[0]) * (base_qps / qps)
    return float(queued_ttft_s(times, service_s).mean())


def qps_at_ttft(
    arrival_s: FloatArray, service_s: FloatArray, target_s: float, hi: float = 1e4
) -> float:
    """Highest request rate whose mean queued TTFT stays within ``target_s`` (bisection)."""
    mean = float(service_s.mean())
    if mean >= target_s:
        return 0.0
    lo, high = 0.0, min(hi, 1.0 / mean)  # at most the server's saturation
    for _ in range(40):
        mid = (lo + high) / 2
        if mid > 0 and loaded_ttft_s(arrival_s, service_s, mid) <= target_s:
            lo = mid
        else:
            high = mid
    return lo
