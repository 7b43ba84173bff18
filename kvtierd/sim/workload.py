"""Workloads for the simulator: model geometry, datasets (paper Table 2, §3.1), request traces.

Everything is deterministic given a seed (``numpy.random.default_rng``).

Modelling choices (the trace has no context identities, DATA README):

* contexts: ``n_contexts`` drawn round-robin from the datasets; a context's length in tokens is
  normal(mean, std) of its dataset in Table 2, clipped to [1,000, model max context];
* popularity: request ``k`` asks for context ``i`` with Zipf probability ``∝ 1 / rank**s``
  over a random permutation of contexts (popularity independent of length and dataset);
* arrivals: Poisson at ``qps``, bursty (Poisson rate modulated by an on/off process), or the
  timestamps of a CSV trace (Azure LLM inference / BurstGPT: timestamp, input, output tokens);
* query length: lognormal with median ``query_tokens_median`` (GPT-generated QA questions, §6.1);
* shared prefix (``shared_prefix_tokens``, default 0: none): the same system prompt of that many
  tokens before every context, so every request needs its KV as well as its own context's
  (how the replay serves it: :mod:`kvtierd.sim.replay`). Contexts are drawn as without one
  (clipped to the model's context less the prefix) and the prefix put in front of each:
  ``context_tokens`` count it, ``own_tokens`` do not.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import MappingProxyType
from typing import TypeVar

import numpy as np

from kvtierd.errors import InvalidArgumentError
from kvtierd.policies.model import BoolArray, FloatArray, IntArray

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """Model geometry for KV size and a roofline prefill-time model.

    ``kv_bytes_per_token = 2 * layers * kv_heads * head_dim * dtype_bytes`` (K and V);
    ``active_params`` counts the parameters used per token (MoE: active experts only).
    """

    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    active_params: float
    max_context_tokens: int
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


MODELS: MappingProxyType[str, ModelPreset] = MappingProxyType(
    {
        "llama-3.1-8b": ModelPreset("llama-3.1-8b", 32, 32, 8, 128, 8.0e9, 131072),
        "mistral-7b": ModelPreset("mistral-7b", 32, 32, 8, 128, 7.2e9, 32768),
        "qwen2.5-14b": ModelPreset("qwen2.5-14b", 48, 40, 8, 128, 14.7e9, 131072),
        "qwen3-30b-a3b": ModelPreset("qwen3-30b-a3b", 48, 32, 4, 128, 3.3e9, 262144),
    }
)
"""Presets from the models' configs (Llama-3.1-8B: 0.125 MiB/token, paper §6.2: 0.12 GB/1K)."""


@dataclass(frozen=True, slots=True)
class DatasetPreset:
    """Context length (Table 2, tokens) and compression sensitivity (§3.1, Fig. 3).

    ``sensitivity_median`` is the median quality drop at 90% of tokens removed (see
    ``quality.py`` for why this reading of §3.1 is the consistent one).
    """

    name: str
    length_mean: float
    length_std: float
    sensitivity_median: float


DATASETS: MappingProxyType[str, DatasetPreset] = MappingProxyType(
    {
        "narrativeqa": DatasetPreset("narrativeqa", 108e3, 55e3, 0.340),
        "qasper": DatasetPreset("qasper", 24e3, 12e3, 0.759),
        "2wikimqa": DatasetPreset("2wikimqa", 30e3, 15e3, 0.681),
        "multi_news": DatasetPreset("multi_news", 12e3, 10e3, 0.738),
        "triviaqa": DatasetPreset("triviaqa", 47e3, 25e3, 0.392),
        "samsum": DatasetPreset("samsum", 34e3, 17e3, 0.676),
    }
)
"""The six datasets for which the paper gives both lengths (Table 2) and sensitivities (§3.1)."""


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """How to generate contexts and requests (see the module docstring)."""

    model: str = "llama-3.1-8b"
    datasets: tuple[str, ...] = tuple(DATASETS)
    n_contexts: int = 555
    n_requests: int = 20000
    zipf_s: float = 0.8
    arrival: str = "poisson"  # poisson | bursty | trace
    qps: float = 5.4  # the Azure conversation trace's mean rate
    trace_path: str = ""
    query_tokens_median: float = 64.0
    seed: int = 0
    shared_prefix_tokens: int = 0


@dataclass(frozen=True, slots=True, eq=False)
class Workload:
    """Contexts ``(n,)`` and requests ``(m,)`` as arrays; ``popularity`` sums to 1.

    ``measured[k]`` is False for a warm-up request: it fills the cache but is not counted.
    ``context_dataset`` names each context's dataset (its compression sensitivity), ``""``
    for a context whose variant qualities were measured instead (:mod:`kvtierd.sim.given`).
    ``shared_prefix_tokens``: the first that many tokens of every context are one shared
    prefix (a system prompt; 0: none), counted in ``context_tokens``.
    """

    model: ModelPreset
    context_tokens: IntArray
    context_dataset: tuple[str, ...]
    popularity: FloatArray
    arrival_s: FloatArray
    request_context: IntArray
    query_tokens: IntArray
    measured: BoolArray
    shared_prefix_tokens: int = 0

    def __post_init__(self) -> None:
        p = self.shared_prefix_tokens
        shortest = int(self.context_tokens.min()) if self.context_tokens.size else 0
        if p < 0 or (p > 0 and p >= shortest):
            raise InvalidArgumentError(
                f"shared_prefix_tokens must be >= 0 and below every context's tokens (the "
                f"shortest has {shortest}: each context holds tokens of its own after the "
                f"prefix), got {p}"
            )

    @property
    def own_tokens(self) -> IntArray:
        """Each context's tokens after the shared prefix: what only it holds."""
        out: IntArray = self.context_tokens - self.shared_prefix_tokens
        return out


def _preset(table: MappingProxyType[str, _T], name: str, what: str) -> _T:
    try:
        return table[name]
    except KeyError:
        raise InvalidArgumentError(f"unknown {what} {name!r}; known: {', '.join(table)}") from None


def make_workload(cfg: WorkloadConfig, warmup_fraction: float = 0.2) -> Workload:
    """Draw contexts, popularity and requests for ``cfg`` (deterministic in ``cfg.seed``); the
    first ``warmup_fraction`` of the requests are warm-up."""
    rng = np.random.default_rng(cfg.seed)
    model = _preset(MODELS, cfg.model, "model")
    sets = [_preset(DATASETS, d, "dataset") for d in cfg.datasets]
    ds = [sets[i % len(sets)] for i in range(cfg.n_contexts)]
    mean = np.array([d.length_mean for d in ds])
    std = np.array([d.length_std for d in ds])
    prefix = cfg.shared_prefix_tokens
    if not 0 <= prefix <= model.max_context_tokens - 1000:
        raise InvalidArgumentError(
            f"shared_prefix_tokens must be in [0, {model.max_context_tokens - 1000}] for "
            f"{model.name} (its {model.max_context_tokens} tokens of context, less the "
            f"shortest document's 1,000), got {prefix}"
        )
    longest = model.max_context_tokens - prefix
    tokens = np.clip(rng.normal(mean, std), 1000, longest).astype(np.int64) + prefix
    ranks = rng.permutation(cfg.n_contexts) + 1
    pop = 1.0 / ranks.astype(np.float64) ** cfg.zipf_s
    pop /= pop.sum()
    arrival = _arrivals(cfg, rng)
    m = arrival.size
    req_ctx = rng.choice(cfg.n_contexts, size=m, p=pop)
    query = np.maximum(8, rng.lognormal(math.log(cfg.query_tokens_median), 0.6, m)).astype(np.int64)
    measured = np.arange(m) >= int(warmup_fraction * m)
    names = tuple(d.name for d in ds)
    return Workload(model, tokens, names, pop, arrival, req_ctx, query, measured, prefix)


def _arrivals(cfg: WorkloadConfig, rng: np.random.Generator) -> FloatArray:
    if cfg.arrival == "trace":
        return load_trace_timestamps(cfg.trace_path, cfg.n_requests)
    if cfg.arrival == "poisson":
        gaps = rng.exponential(1.0 / cfg.qps, cfg.n_requests)
    elif cfg.arrival == "bursty":
        # On/off modulation: bursts at 4x the mean rate a fifth of the time keep the mean rate.
        burst = rng.random(cfg.n_requests) < 0.2
        rate = np.where(burst, 4.0 * cfg.qps, 0.25 * cfg.qps)
        gaps = rng.exponential(1.0 / rate)
    else:
        raise InvalidArgumentError(
            f"unknown arrival {cfg.arrival!r}; known: poisson, bursty, trace"
        )
    return np.cumsum(gaps)


def load_trace_timestamps(path: str, limit: int = 0) -> FloatArray:
    """Arrival times (seconds from the first request) from a CSV trace.

    Accepts the Azure LLM inference format (``TIMESTAMP,ContextTokens,GeneratedTokens`` with
    ISO timestamps) and BurstGPT (``Timestamp`` in seconds as the first column).
    """
    if not path:
        raise InvalidArgumentError("arrival 'trace' needs trace_path (e.g. --trace FILE.csv)")
    times: list[float] = []
    with Path(path).open(newline="") as f:
        reader = csv.reader(f)
        next(reader, None)  # header
        for row in reader:
            if not row:
                continue
            stamp = row[0].strip()
            try:
                times.append(float(stamp))
            except ValueError:
                times.append(datetime.fromisoformat(stamp[:26]).timestamp())
            if limit and len(times) >= limit:
                break
    if not times:
        raise InvalidArgumentError(f"trace {path!r} has no requests")
    t = np.sort(np.array(times, dtype=np.float64))
    out: FloatArray = t - t[0]
    return out
