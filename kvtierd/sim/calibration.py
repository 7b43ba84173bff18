"""A calibration: what one serving stack measured, for the simulator to predict it.

A YAML file (docs/simulator.md has an annotated one)::

    prefill:                  # a miss: overhead_s + seconds_per_token * (context + query tokens)
      samples: [[768, 1.45], [1792, 3.4], [3584, 6.05]]   # [context tokens, TTFT s], or:
      # overhead_s: 0.2
      # seconds_per_token: 0.0016
    query_tokens: 40          # the probes' query length, for samples that do not give theirs
    decode_s: 0.5             # the LLM server stays busy this long after each first token
    batch: {max_seqs: 8, max_tokens: 8192}   # prompts prefilled together (default: one)
    tiers:                    # fastest first; names as in the workload file
      - name: cpu             # a hit: prefill of the query + overhead_s + bytes / bandwidth
        samples: [[768, 0.25], [3584, 0.55]]             # [context tokens, TTFT s], or:
        # overhead_s: 0.15
        # bandwidth_bytes_per_s: 2.0e8
    quality:                  # measured quality per variant, for contexts without their own
      knorm@0.5: 0.83

A sample may give its own query length third (``[768, 1.45, 52]``). Samples are TTFTs measured
**one request at a time** (no queueing) and fitted by least squares:
the prefill line over the probes' prompt lengths; a tier's overhead and bandwidth over the
context's bytes after taking the query's prefill out (``tier TTFT - prefill(query)``). A fit
whose intercept comes out negative is refitted through the origin (no overhead). A tier whose
load does not grow with the context's size at the lengths sampled (its cost per byte is below
the noise: the plugin moves a 4k-token context in milliseconds here, a hit's fixed costs take
tenths of a second) is a fixed ``overhead_s``, the samples' mean, with no per-byte cost
(bandwidth ``inf``). Samples and explicit figures mix: an explicit one is kept and only the
other fitted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import yaml

from kvtierd.errors import InvalidArgumentError
from kvtierd.sim.timing import Batching, LinearPrefill
from kvtierd.sim.variant_space import Form
from kvtierd.sim.yaml_doc import YamlDoc
from kvtierd.types import ORIGINAL_VARIANT

_TOP = ("prefill", "query_tokens", "decode_s", "batch", "tiers", "quality")
_BATCH = ("max_seqs", "max_tokens")
_PREFILL = ("samples", "overhead_s", "seconds_per_token")
_TIER = ("name", "samples", "overhead_s", "bandwidth_bytes_per_s")


@dataclass(frozen=True, slots=True)
class Sample:
    """One request measured alone: its context and query lengths (tokens) and its TTFT."""

    context_tokens: float
    ttft_s: float
    query_tokens: float


@dataclass(frozen=True, slots=True)
class TierSpeed:
    """A tier's measured load model (capacity comes from the workload)."""

    name: str
    load_bandwidth_bytes_per_s: float
    load_overhead_s: float


@dataclass(frozen=True, slots=True)
class Calibration:
    """The measured LLM server (vLLM): prefill line, per-tier load model, decode time, qualities."""

    prefill: LinearPrefill
    tiers: tuple[TierSpeed, ...]
    decode_s: float
    quality: Mapping[str, float]
    source: str
    batching: Batching = field(default_factory=Batching)

    def summary(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "prefill_overhead_s": self.prefill.overhead_s,
            "prefill_seconds_per_token": self.prefill.seconds_per_token,
            "decode_s": self.decode_s,
            "batch": {
                "max_seqs": self.batching.max_seqs,
                "max_tokens": self.batching.max_tokens
                if math.isfinite(self.batching.max_tokens)
                else None,
            },
            "tiers": [
                {
                    "name": t.name,
                    "overhead_s": t.load_overhead_s,
                    # None: a fixed cost, no per-byte term (JSON has no infinity)
                    "bandwidth_bytes_per_s": t.load_bandwidth_bytes_per_s
                    if math.isfinite(t.load_bandwidth_bytes_per_s)
                    else None,
                }
                for t in self.tiers
            ],
            "quality": dict(self.quality),
        }


def fit_line(
    x: list[float], y: list[float], intercept: float | None = None, slope: float | None = None
) -> tuple[float, float]:
    """Least-squares ``y = intercept + slope * x`` for what is not given. Both free: needs two
    distinct ``x``, and a negative intercept is refitted as 0 (through the origin)."""
    xs, ys = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if intercept is None and slope is None:
        if np.unique(xs).size < 2:
            raise ValueError("needs samples at two or more different lengths")
        fit_s, fit_o = np.polyfit(xs, ys, 1)
        if fit_o >= 0:
            return float(fit_o), float(fit_s)
        intercept = 0.0
    if slope is None:
        o = 0.0 if intercept is None else intercept
        return o, float(xs @ (ys - o) / (xs @ xs))
    if intercept is None:
        return max(0.0, float(np.mean(ys - slope * xs))), slope
    return intercept, slope


class _Doc(YamlDoc):
    """Reads one calibration document; every error names the file and the key."""

    def samples(self, value: object, where: str, query_tokens: float) -> list[Sample]:
        """``[context tokens, TTFT s]`` pairs (query of ``query_tokens``), or triples with
        the query's own length third."""
        if not isinstance(value, list) or not all(
            isinstance(s, list) and len(s) in (2, 3) for s in value
        ):
            raise self.fail(
                where, "expected a list of [context tokens, TTFT seconds(, query tokens)]"
            )
        return [
            Sample(
                self.number(s[0], where, positive=True),
                self.number(s[1], where),
                self.number(s[2], where) if len(s) == 3 else query_tokens,
            )
            for s in value
        ]


def parse_calibration(text: str, source: str, kv_bytes_per_token: int) -> Calibration:
    """Validate and fit a calibration document (module docstring); ``kv_bytes_per_token`` turns
    the tier samples' context tokens into bytes."""
    doc = _Doc(source)
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise doc.fail("document", f"not valid YAML: {e}") from e
    top = doc.table(raw, "document", _TOP)
    query = doc.number(top.get("query_tokens", 0), "query_tokens")
    prefill = _prefill(doc, top.get("prefill"), query)
    tiers_raw = top.get("tiers")
    if not isinstance(tiers_raw, list) or not tiers_raw:
        raise doc.fail("tiers", "expected a list of tiers, fastest first")
    tiers = tuple(
        _tier(doc, t, f"tiers[{i}]", query=query, prefill=prefill, per_token=kv_bytes_per_token)
        for i, t in enumerate(tiers_raw)
    )
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise doc.fail("tiers", f"tier names repeat: {names}")
    return Calibration(
        prefill=prefill,
        tiers=tiers,
        decode_s=doc.number(top.get("decode_s", 0.0), "decode_s"),
        quality=_quality(doc, top.get("quality", {})),
        source=source,
        batching=_batching(doc, top.get("batch", {})),
    )


def _batching(doc: _Doc, value: object) -> Batching:
    t = doc.table(value, "batch", _BATCH)
    seqs = t.get("max_seqs", 1)
    if isinstance(seqs, bool) or not (isinstance(seqs, int) and seqs >= 1):
        raise doc.fail("batch.max_seqs", f"expected an integer >= 1, got {seqs!r}")
    tokens = t.get("max_tokens")
    limit = math.inf if tokens is None else doc.number(tokens, "batch.max_tokens", positive=True)
    return Batching(seqs, limit)


def load_calibration(path: str | Path, kv_bytes_per_token: int) -> Calibration:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise InvalidArgumentError(f"calibration {path}: cannot read: {e.strerror}") from e
    return parse_calibration(text, str(path), kv_bytes_per_token)


def _prefill(doc: _Doc, value: object, query_tokens: float) -> LinearPrefill:
    t = doc.table(value, "prefill", _PREFILL)
    overhead = _given(doc, t, "overhead_s", "prefill.overhead_s")
    slope = _given(doc, t, "seconds_per_token", "prefill.seconds_per_token")
    if "samples" in t:
        samples = doc.samples(t["samples"], "prefill.samples", query_tokens)
        x = [s.context_tokens + s.query_tokens for s in samples]
        try:
            overhead, slope = fit_line(x, [s.ttft_s for s in samples], overhead, slope)
        except ValueError as e:
            raise doc.fail("prefill.samples", f"{e}; or give seconds_per_token") from e
    if slope is None or overhead is None:
        raise doc.fail("prefill", "give samples, or overhead_s and seconds_per_token")
    return LinearPrefill(
        doc.number(slope, "prefill.seconds_per_token", positive=True),
        doc.number(overhead, "prefill.overhead_s"),
    )


def _tier(
    doc: _Doc, value: object, where: str, *, query: float, prefill: LinearPrefill, per_token: int
) -> TierSpeed:
    t = doc.table(value, where, _TIER)
    name = t.get("name")
    if not isinstance(name, str) or not name:
        raise doc.fail(f"{where}.name", "expected the tier's name")
    overhead = _given(doc, t, "overhead_s", f"{where}.overhead_s")
    bw = _given(doc, t, "bandwidth_bytes_per_s", f"{where}.bandwidth_bytes_per_s")
    if "samples" in t:
        samples = doc.samples(t["samples"], f"{where}.samples", query)
        size = [s.context_tokens * per_token for s in samples]
        queries = np.array([s.query_tokens for s in samples])
        # the hit's own prefill of its query (and the LLM server's overhead) is not the load
        query_s = prefill.seconds(queries, np.zeros_like(queries))
        load = [s.ttft_s - q for s, q in zip(samples, query_s.tolist(), strict=True)]
        given = overhead
        try:
            overhead, per_byte = fit_line(size, load, overhead, None if bw is None else 1 / bw)
        except ValueError as e:
            raise doc.fail(f"{where}.samples", f"{e}; or give bandwidth_bytes_per_s") from e
        if per_byte > 0:
            bw = 1.0 / per_byte
        else:  # a fixed cost: the cost per byte is below what these samples can tell
            bw = math.inf
            overhead = given if given is not None else max(0.0, float(np.mean(load)))
    if overhead is None or bw is None:
        raise doc.fail(where, "give samples, or overhead_s and bandwidth_bytes_per_s")
    if math.isfinite(bw):
        bw = doc.number(bw, f"{where}.bandwidth_bytes_per_s", positive=True)
    return TierSpeed(name, bw, doc.number(overhead, f"{where}.overhead_s"))


def _given(doc: _Doc, table: dict[str, Any], key: str, where: str) -> float | None:
    value = table.get(key)
    return None if value is None else doc.number(value, where, positive=key != "overhead_s")


def _quality(doc: _Doc, value: object) -> Mapping[str, float]:
    if not isinstance(value, dict):
        raise doc.fail("quality", "expected a mapping of variant name to quality")
    out = {ORIGINAL_VARIANT: 1.0}
    for name, q in value.items():
        where = f"quality.{name}"
        try:
            Form.of(str(name))
        except InvalidArgumentError as e:
            raise doc.fail(where, str(e)) from e
        number = doc.number(q, where)
        if number > 1:
            raise doc.fail(where, f"a quality is in [0, 1], got {number}")
        out[str(name)] = number
    return MappingProxyType(out)
