"""A workload given as a file: the contexts and requests a benchmark actually sent.

JSON (``benchmarks/e2e/sim_e2e.py`` writes one for ``bench_e2e.py``'s workload)::

    {"model": {"name": "SmolLM2-135M-Instruct", "layers": 30, "q_heads": 9, "kv_heads": 3,
               "head_dim": 64, "active_params": 1.35e8, "max_context_tokens": 8192,
               "dtype_bytes": 2},
     "tiers": [{"name": "cpu", "capacity_bytes": 9300000}, {"name": "ssd", ...}],
     "contexts": [{"tokens": 1024, "quality": {"knorm@0.5": 0.81},
                   "profile": {"knorm@0.5": 0.74, "int4": 0.91}}, ...],
     "requests": [{"index": 0, "at_s": 0.0, "context": 3, "query_tokens": 41,
                   "measured": true}, ...]}

Requests are in time order; ``measured: false`` marks warm-up requests (they fill the cache and
count as accesses but are not predicted). A context's ``quality`` (optional) holds its measured
quality per variant; the calibration's ``quality`` covers the others, and a variant with neither
is not offered for that context. The oracle frequency of a context is its number of requests.

A context's ``profile`` (optional) is what the placer is told: the quality per variant that the
daemon's estimator profiled (``benchmarks/e2e/sim_e2e.py`` takes it from the measured daemon's
profiles). Where a context has one, the placer is offered the variants it names, at its
qualities, and decides on them; a request is still served at the measured ``quality`` (the
profile's where none was measured). Without one the placer decides on the measured quality,
as before: then a variant no system measured (``int4`` beside a run that measured only
``fixed-int8``) was never offered, though the daemon's EvicPress stored a third of its
contexts as int4 (issue 30, seed 2 of the matrix).

``shared_prefix_tokens`` (optional, default 0) says that the first that many tokens of every
context are one shared prefix (a system prompt before every document; ``tokens`` count it): the
replay serves it as one more context every request needs (:mod:`kvtierd.sim.replay`), and a
context's variants hold only its own tokens after it.

``chunk_tokens`` (optional, default 1) is the size of the chunks the contexts' KV is stored in
(LMCache's ``chunk_size``): a token-dropped form keeps whole chunks, as the daemon sizes it
(:func:`kvtierd.sim.variant_space.shape`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvtierd.errors import InvalidArgumentError
from kvtierd.sim.calibration import Calibration
from kvtierd.sim.replay import Prepared, prepared
from kvtierd.sim.variant_space import Form, VariantTable, shape
from kvtierd.sim.workload import ModelPreset, Workload
from kvtierd.types import ORIGINAL_VARIANT, TierModel


@dataclass(frozen=True, slots=True, eq=False)
class GivenWorkload:
    """A loaded workload file: ``ids`` are the measured requests' ``index`` values, in order."""

    workload: Workload
    capacity_bytes: Mapping[str, int | None]
    quality: tuple[Mapping[str, float], ...]
    ids: tuple[int, ...]
    source: str
    profile: tuple[Mapping[str, float], ...] = ()
    chunk_tokens: int = 1


def _fail(source: str, where: str, problem: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{source}: {where}: {problem}")


def _model(source: str, raw: object) -> ModelPreset:
    names = [f.name for f in fields(ModelPreset)]
    if not isinstance(raw, dict) or set(raw) - set(names):
        raise _fail(source, "model", f"expected a mapping with keys {', '.join(names)}")
    try:
        return ModelPreset(**raw)
    except TypeError as e:
        raise _fail(source, "model", str(e)) from e


def _requests(source: str, raw: object, n: int) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise _fail(source, "requests", "expected a non-empty list")
    last = -np.inf
    for k, r in enumerate(raw):
        where = f"requests[{k}]"
        if not isinstance(r, dict) or not {"at_s", "context", "query_tokens"} <= set(r):
            raise _fail(source, where, "expected at_s, context, query_tokens (index, measured)")
        if not (isinstance(r["context"], int) and 0 <= r["context"] < n):
            raise _fail(source, where, f"context must be an index below {n}, got {r['context']!r}")
        if not float(r["at_s"]) >= last:
            raise _fail(source, where, "requests must be in time order (at_s not decreasing)")
        if not int(r["query_tokens"]) >= 1:
            raise _fail(source, where, "query_tokens must be >= 1")
        last = float(r["at_s"])
    return raw


def _qualities(source: str, where: str, raw: object) -> dict[str, float]:
    """A ``{variant: quality}`` mapping, each quality a number in [0, 1]."""
    if not isinstance(raw, dict) or not all(
        isinstance(q, int | float) and not isinstance(q, bool) and 0.0 <= q <= 1.0
        for q in raw.values()
    ):
        raise _fail(source, where, f"expected {{variant: quality in [0, 1]}}, got {raw!r}")
    return {str(k): float(q) for k, q in raw.items()}


def parse_workload(doc: object, source: str) -> GivenWorkload:
    """Validate a workload document (module docstring)."""
    if not isinstance(doc, dict) or not {"model", "tiers", "contexts", "requests"} <= set(doc):
        raise _fail(source, "document", "expected keys model, tiers, contexts, requests")
    model = _model(source, doc["model"])
    contexts = doc["contexts"]
    if not isinstance(contexts, list) or not contexts:
        raise _fail(source, "contexts", "expected a non-empty list")
    tokens = []
    for i, c in enumerate(contexts):
        if not (isinstance(c, dict) and isinstance(c.get("tokens"), int) and c["tokens"] > 0):
            raise _fail(source, f"contexts[{i}]", "expected {'tokens': N > 0, 'quality': {...}}")
        tokens.append(c["tokens"])
    reqs = _requests(source, doc["requests"], len(contexts))
    tiers = doc["tiers"]
    if not isinstance(tiers, list) or not all(isinstance(t, dict) and "name" in t for t in tiers):
        raise _fail(source, "tiers", "expected a list of {name, capacity_bytes}, fastest first")
    shared = doc.get("shared_prefix_tokens", 0)
    if isinstance(shared, bool) or not (isinstance(shared, int) and 0 <= shared < min(tokens)):
        raise _fail(source, "shared_prefix_tokens", f"expected an integer in [0, {min(tokens)}) "
                    f"(below every context's tokens), got {shared!r}")  # fmt: skip
    chunk = doc.get("chunk_tokens", 1)
    if isinstance(chunk, bool) or not (isinstance(chunk, int) and chunk >= 1):
        raise _fail(source, "chunk_tokens", f"expected an integer >= 1, got {chunk!r}")
    req_ctx = np.array([r["context"] for r in reqs], dtype=np.int64)
    counts = np.bincount(req_ctx, minlength=len(tokens)).astype(np.float64)
    measured = np.array([bool(r.get("measured", True)) for r in reqs])
    wl = Workload(
        model=model,
        context_tokens=np.array(tokens, dtype=np.int64),
        context_dataset=("",) * len(tokens),
        popularity=counts / counts.sum(),
        arrival_s=np.array([float(r["at_s"]) for r in reqs]),
        request_context=req_ctx,
        query_tokens=np.array([int(r["query_tokens"]) for r in reqs], dtype=np.int64),
        measured=measured,
        shared_prefix_tokens=shared,
    )
    return GivenWorkload(
        workload=wl,
        capacity_bytes={str(t["name"]): t.get("capacity_bytes") for t in tiers},
        quality=tuple(dict(c.get("quality", {})) for c in contexts),
        profile=tuple(
            _qualities(source, f"contexts[{i}].profile", c.get("profile", {}))
            for i, c in enumerate(contexts)
        ),
        ids=tuple(int(r.get("index", k)) for k, r in enumerate(reqs) if measured[k]),
        source=source,
        chunk_tokens=chunk,
    )


def load_workload(path: str | Path) -> GivenWorkload:
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise InvalidArgumentError(f"workload {path}: cannot read: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise InvalidArgumentError(f"workload {path}: not valid JSON: {e}") from e
    return parse_workload(doc, str(path))


FIXED_COST_BANDWIDTH = 1e15  # B/s: a 100 MB context in 0.1 us, nothing next to any overhead


def calibrated_tiers(given: GivenWorkload, cal: Calibration) -> tuple[TierModel, ...]:
    """The workload's tiers (capacities) with the calibration's load models, fastest first."""
    speeds = {t.name: t for t in cal.tiers}
    out = []
    for name, capacity in given.capacity_bytes.items():
        if name not in speeds:
            raise InvalidArgumentError(
                f"tier {name!r} of {given.source} has no load model in {cal.source} "
                f"(calibrated: {', '.join(speeds)})"
            )
        s = speeds[name]
        # A fixed-cost tier (bandwidth inf: its loads did not grow with size) is priced per
        # byte at FIXED_COST_BANDWIDTH: the placers refuse a bandwidth that is not finite
        bw = min(s.load_bandwidth_bytes_per_s, FIXED_COST_BANDWIDTH)
        out.append(TierModel(name, capacity, bw, s.load_overhead_s))
    return tuple(out)


def measured_variants(given: GivenWorkload, cal: Calibration) -> tuple[str, ...]:
    """Every variant some context has a quality or a profile for, ``none`` first."""
    names = dict.fromkeys([ORIGINAL_VARIANT, *cal.quality])
    for q in (*given.quality, *given.profile):
        names.update(dict.fromkeys(q))
    return tuple(names)


def calibrated_prepare(given: GivenWorkload, cal: Calibration, variants: Sequence[str]) -> Prepared:
    """Profiles of the given contexts: sizes from the model's geometry, measured qualities
    (``NaN``, so not offered, where neither the context nor the calibration has one), no
    restore cost (a measured tier overhead includes it), the calibration's prefill line. A
    context with a ``profile`` is offered what it names, at its qualities, and served at the
    measured quality (the profile's where none was measured: module docstring)."""
    wl = given.workload
    names = tuple(dict.fromkeys([ORIGINAL_VARIANT, *variants]))
    tokens = wl.own_tokens.astype(np.float64)  # a shared prefix is its own context
    n, v = tokens.size, len(names)
    size, kept = np.empty((n, v)), np.empty((n, v))
    served, told = np.full((n, v), np.nan), np.full((n, v), np.nan)
    profiles = given.profile or ({},) * n
    for j, name in enumerate(names):
        per_token = float(wl.model.kv_bytes_per_token)
        sh = shape(Form.of(name), tokens, per_token, wl.model.dtype_bytes, given.chunk_tokens)
        size[:, j], kept[:, j] = sh.size_bytes, sh.kept_tokens
        for i, (own, profile) in enumerate(zip(given.quality, profiles, strict=True)):
            measured = own.get(name, cal.quality.get(name))
            seen = profile.get(name) if profile else measured
            if measured is None:
                measured = seen
            served[i, j] = np.nan if measured is None else float(measured)
            told[i, j] = np.nan if seen is None else float(seen)
    restore = np.zeros((n, v))
    prep = prepared(wl, VariantTable(names, size, served, restore, kept), cal.prefill)
    if not any(profiles):
        return prep
    # the placer decides on what the estimator told it; requests are served as measured
    told_prep = prepared(wl, VariantTable(names, size, told, restore, kept), cal.prefill)
    return replace(prep, profiles=told_prep.profiles)
