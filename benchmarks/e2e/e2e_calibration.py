"""The simulator's calibration, fitted from ``bench_e2e``'s own measurements (issue 13.4).

A calibration (``kvtierd/sim/calibration.py``) needs **service times**: how long a request takes
from sending to first token when nothing else is queued before it. ``bench_e2e`` writes per
system every timed request (``<system>.json``, ``outcomes``: when it was sent, its TTFT) and,
where it records them, the warm-up requests (``warmup``: each context once, one at a time, so
their TTFTs are service times). A timed request's service time is estimated from the run:
taking the requests in the order of their first tokens, its first token minus the later of its
sending and the previous request's first token. That is exact for a request that ran alone and,
under load, splits the engine's busy time between the requests it served (when vLLM prefills
two prompts in one step, one of them gets almost all of it). An overloaded run splits it badly:
the 16-context run's ``prefill`` system (61 s mean TTFT, every request queued) gave 768-token
prompts from 0.0001 s to 16.6 s, and a line through those predicted misses 2-4 times slower than
measured. So a fit takes only the requests that **ran alone** (:func:`ran_alone`: no other
request in flight, sent and not finished, between its sending and its first token), and falls
back to the estimates only when those cover fewer than two lengths. From those:

* **the prefill line**: the ``prefill`` system's warm-up and timed requests, and the misses of
  every other measured system (nothing of the context cached: vLLM computed the whole prompt,
  through the same router and plugin);
* **the tiers' load model**: the timed requests of a system that loaded their whole context:
  vLLM's usage says how many prompt tokens were cached (``cached_tokens`` in the outcome, which
  ``bench_e2e`` records since issue 13.3); for a run without it, LMCache's log line per request
  (prompt length and hit tokens when it is scheduled, ``work/<system>/vllm.log``, matched to
  the requests in sending order by prompt length). Neither says which tier served a hit:
  every tier gets the same samples, one load model for all. kvtierd's tiers come from the
  ``lru`` system (no compression: every hit loads the original), LMCache's from ``lmcache``.

The result is written as calibration YAML beside the measurements, each sample
``[context tokens, service s, query tokens]``, so the fit can be read and rerun with ``kvtierd
sim predict``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from kvtierd.sim.calibration import Calibration
    from kvtierd.sim.timing import Batching, LinearPrefill

TIER_SOURCE = {"kvtierd": "lru", "lmcache": "lmcache"}
"""Which measured system calibrates the tiers of each backend."""


@dataclass(frozen=True, slots=True)
class Service:
    """A request's context and query lengths (tokens) and its service time (s)."""

    context_tokens: int
    query_tokens: int
    service_s: float

    def row(self) -> list[float]:
        return [self.context_tokens, round(self.service_s, 4), self.query_tokens]


def service_times(outcomes: list[dict[str, Any]]) -> dict[int, float]:
    """Per request (``index``, errors left out): its service time (module docstring)."""
    ok = [o for o in outcomes if not o["error"]]
    out, previous = {}, -np.inf
    for o in sorted(ok, key=lambda o: o["sent_s"] + o["ttft_s"]):
        first = o["sent_s"] + o["ttft_s"]
        out[o["index"]] = first - max(previous, o["sent_s"])
        previous = first
    return out


HIT_LINE = re.compile(r"Reqid: (\S+), Total tokens (\d+), .*LMCache hit tokens: (\d+)")


def logged_hits(log: Path) -> list[tuple[int, int]]:
    """``(prompt tokens, LMCache hit tokens)`` per request, in the order vLLM scheduled them
    (the first line of each request id)."""
    seen: dict[str, tuple[int, int]] = {}
    for line in log.read_text(errors="replace").splitlines():
        m = HIT_LINE.search(line)
        if m and m.group(1) not in seen:
            seen[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    return list(seen.values())


class Lengths:
    """Context and query lengths of the workload file's (context, question) pairs."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.context = [int(c["tokens"]) for c in doc["contexts"]]
        self.shared = int(doc.get("shared_prefix_tokens", 0))
        self.warmup = [  # (context, question, index) of the warm-up requests, in order
            (r["context"], r.get("question", 0), r["index"])
            for r in doc["requests"]
            if not r.get("measured", True)
        ]
        self.query = {
            (r["context"], r.get("question", 0)): r["query_tokens"] for r in doc["requests"]
        }

    def service(self, o: dict[str, Any], service_s: float) -> Service:
        c, q = o["context"], o["question"]
        return Service(self.context[c], int(self.query[c, q]), service_s)


def ran_alone(outcomes: list[dict[str, Any]]) -> set[int]:
    """The requests (``index``) that had the engine to themselves from their sending to their
    first token: no other request was in flight then (sent, and its answer not finished)."""
    ok = [o for o in outcomes if not o["error"]]
    alone = set()
    for o in ok:
        start, first = o["sent_s"], o["sent_s"] + o["ttft_s"]
        if not any(p is not o and p["sent_s"] < first and p["sent_s"] + p["total_s"] > start
                   for p in ok):  # fmt: skip
            alone.add(o["index"])
    return alone


def _fit_samples(
    runs: list[tuple[list[dict[str, Any]], set[int]]], lengths: Lengths
) -> list[Service]:
    """Per run (its outcomes and the requests to take): those that ran alone, as measured;
    when they cover fewer than two context lengths, every taken request's estimated service
    time instead (module docstring)."""
    alone = []
    for outcomes, taken in runs:
        solo = ran_alone(outcomes) & taken
        alone += [lengths.service(o, o["ttft_s"]) for o in outcomes if o["index"] in solo]
    if len({s.context_tokens for s in alone}) >= 2:
        return alone
    estimated = []
    for outcomes, taken in runs:
        timed = service_times(outcomes)
        estimated += [lengths.service(o, timed[o["index"]]) for o in outcomes
                      if o["index"] in timed and o["index"] in taken]  # fmt: skip
    return estimated


def prefill_samples(
    measured: dict[str, Any], lengths: Lengths, others: Sequence[dict[str, Any]] = ()
) -> list[Service]:
    """The ``prefill`` system's warm-up (as measured) and timed requests, and the full misses
    of the ``others`` (measured runs with vLLM's usage per outcome), as :func:`_fit_samples`
    takes them."""
    warm = [lengths.service(o, o["ttft_s"]) for o in warmup_outcomes(measured, lengths)]
    runs = [(measured["outcomes"], {o["index"] for o in measured["outcomes"]})]
    for run in others:
        misses = {o["index"] for o in run["outcomes"]
                  if o.get("cached_tokens", -1) == 0 and not o["served_from"]}  # fmt: skip
        runs.append((run["outcomes"], misses))
    return warm + _fit_samples(runs, lengths)


def warmup_outcomes(measured: dict[str, Any], lengths: Lengths) -> list[dict[str, Any]]:
    """A run's warm-up requests that did not fail, each with its ``question``: bench_e2e
    records the warm-up as ``{context, sent_unix_s, ttft_s, total_s}`` in the order it sent
    them (the workload file's warm-up order, which gives the question); runs before issue 26
    recorded outcomes like the timed ones."""
    out = []
    for k, o in enumerate(measured.get("warmup", [])):
        if o.get("error"):
            continue
        question = o.get("question")
        if question is None and k < len(lengths.warmup):
            question = lengths.warmup[k][1]
        out.append(o | {"question": question or 0})
    return out


def miss_samples(runs: Sequence[dict[str, Any]], lengths: Lengths) -> list[Service]:
    """The requests of cached systems' runs that computed their whole prompt: each warm-up
    request (as measured: one at a time, and a run starts empty) and each timed request vLLM
    found nothing of (``cached_tokens`` 0, not served from a variant), as
    :func:`_fit_samples` takes them. They time the prefill of the cached systems' vLLM, which
    is not the ``prefill`` system's: a connector's vLLM may serve in another dtype (float32
    on an AMX CPU against the ``prefill`` system's bfloat16: twice as slow in the 8-context
    run of issue 26, ``cpu_dtype.py``)."""
    warm = []
    for run in runs:  # behind a shared prefix only a run's first request computed it all
        first = warmup_outcomes(run, lengths)[: 1 if lengths.shared else None]
        warm += [lengths.service(o, o["ttft_s"]) for o in first]
    timed = []
    for run in runs:
        misses = {o["index"] for o in run["outcomes"]
                  if o.get("cached_tokens", -1) == 0 and not o["served_from"]}  # fmt: skip
        timed.append((run["outcomes"], misses))
    return warm + _fit_samples(timed, lengths)


def measured_hits(measured: dict[str, Any], lengths: Lengths, log: Path) -> dict[int, bool] | None:
    """Per timed request (``index``): whether it loaded its whole context — from vLLM's usage
    in the outcome (``cached_tokens``) where every outcome has it, else from vLLM's log (module
    docstring). ``None`` when neither says (no usage, no log or a log that does not match)."""
    outs = measured["outcomes"]
    if outs and all(o.get("cached_tokens", -1) >= 0 for o in outs):
        # a token-dropped variant is served as placeholders + suffix: fewer tokens than the
        # context, all of them loaded (the router names it in served_from)
        return {
            o["index"]: bool(o["served_from"])
            or o["cached_tokens"] >= lengths.context[o["context"]]
            for o in outs
        }
    if not log.exists():
        return None
    left = logged_hits(log)
    warm = lengths.warmup
    timed = sorted(outs, key=lambda o: o["sent_s"])
    out = {}
    for c, q, index in warm + [(o["context"], o["question"], o["index"]) for o in timed]:
        total = lengths.context[c] + int(lengths.query[c, q])
        k = next((k for k, (n, _) in enumerate(left) if n == total), None)
        if k is None:
            return None
        out[index] = left.pop(k)[1] >= lengths.context[c]
    return {i: hit for i, hit in out.items() if i >= 0}


def hit_samples(measured: dict[str, Any], lengths: Lengths, hits: dict[int, bool]) -> list[Service]:
    """A system's timed requests that loaded their whole context (``hits``, vLLM's log), as
    :func:`_fit_samples` takes them."""
    loaded = {i for i, hit in hits.items() if hit}
    return _fit_samples([(measured["outcomes"], loaded)], lengths)


def calibration_yaml(
    prefill: list[Service],
    hits: list[Service],
    tiers: list[str],
    source: str,
    *,
    decode_s: float = 0.0,
    batch: dict[str, int] | None = None,
) -> str:
    """A calibration document (``kvtierd/sim/calibration.py``'s format) with its provenance."""
    import yaml

    doc: dict[str, Any] = {
        "prefill": {"samples": [s.row() for s in prefill]},
        "decode_s": round(decode_s, 3),
        **({"batch": batch} if batch else {}),
        "tiers": [{"name": t, "samples": [s.row() for s in hits]} for t in tiers],
    }
    if len({s.context_tokens for s in hits}) < 2:  # one length: no overhead can be told apart
        doc["tiers"] = [t | {"overhead_s": 0.0} for t in doc["tiers"]]
    if len({s.context_tokens for s in prefill}) < 2:  # nor here: through the origin, as the
        doc["prefill"]["overhead_s"] = 0.0  # fits at two lengths come out (issue 30's runs)
    doc |= {"quality": {}}
    head = (
        f"# Fitted by benchmarks/e2e/sim_e2e.py from {source}\n"
        "# (benchmarks/e2e/e2e_calibration.py):\n"
        f"# prefill: {len(prefill)} requests (the prefill system's, other systems' misses); "
        f"tiers: {len(hits)} hits\n# (vLLM's usage or LMCache's log), the same samples for "
        "every tier (neither says which).\n# Each as measured where it ran alone, else as "
        "estimated. Samples: [context tokens, service s, query tokens].\n"
        "# decode_s: the hold after each first token that best gives the prefill system's\n"
        "# measured TTFTs (0: vLLM interleaves decoding with the next prefill); batch: how\n"
        "# the measured vLLM batched prefills (its max_num_seqs, max_num_batched_tokens).\n"
    )
    return head + yaml.safe_dump(doc, default_flow_style=None, sort_keys=False, width=100)


DECODE_STEP_S = 0.01


def fit_decode_s(
    measured: dict[str, Any], lengths: Lengths, prefill: LinearPrefill, batching: Batching
) -> float:
    """The seconds vLLM stays busy after each first token (``decode_s``: the simulator's one
    LLM server holds that long before the next prefill) that best give the ``prefill``
    system's measured TTFTs (least squares over its timed requests, each prefilled whole at
    ``prefill``, queued at its measured sending time and batched as vLLM was), searched in steps of
    :data:`DECODE_STEP_S` up to the longest measured decode (first to last token). In issue
    26's runs it is 0: a request's decode did not hold the next prefill back."""
    from kvtierd.sim.timing import batched_ttft_s

    outs = sorted((o for o in measured["outcomes"] if not o["error"]), key=lambda o: o["sent_s"])
    if not outs:
        return 0.0
    sent = np.array([o["sent_s"] for o in outs])
    got = np.array([o["ttft_s"] for o in outs])
    tokens = np.array([float(s.context_tokens + s.query_tokens)
                       for s in (lengths.service(o, 0.0) for o in outs)])  # fmt: skip
    service = prefill.seconds(tokens, np.zeros_like(tokens))
    longest = max(o["total_s"] - o["ttft_s"] for o in outs)
    holds = np.arange(0.0, max(longest, 0.0) + DECODE_STEP_S, DECODE_STEP_S)
    errors = [float(np.sum((batched_ttft_s(sent, service, tokens, batching, h) - got) ** 2))
              for h in holds]  # fmt: skip
    return float(holds[int(np.argmin(errors))])


def quantized_hits(out: Path, lengths: Lengths, doc: dict[str, Any]) -> list[Service]:
    """The hits of every measured ``fixed-<V>`` system whose ``V`` keeps every token (int8,
    int4), each as the tokens of original KV its bytes amount to: what tells a load's cost per
    byte from the query's prefill, which at the two lengths of the lru system's hits vary
    together (in issue 26's runs an int8 hit, 0.28 of the bytes, took as long as an original's:
    the load is a fixed cost there)."""
    from kvtierd.sim.variant_space import Form, quant_ratio

    dtype_bytes = int(doc["model"]["dtype_bytes"])
    samples = []
    for path in sorted(out.glob("fixed-*.json")):
        form = Form.of(path.stem.removeprefix("fixed-"))
        if form.method or not form.quant:
            continue
        run = json.loads(path.read_text())
        logged = measured_hits(run, lengths, out / "work" / path.stem / "vllm.log")
        ratio = quant_ratio(form.quant, dtype_bytes)
        for s in hit_samples(run, lengths, logged or {}):
            samples.append(replace(s, context_tokens=round(s.context_tokens * ratio)))
    return samples


VLLM_BATCH = re.compile(r"'max_num_batched_tokens': (\d+), 'max_num_seqs': (\d+)")


def vllm_batching(out: Path) -> dict[str, int] | None:
    """How the measured vLLM batched prefills (its non-default arguments in the first
    ``<out>/work/<system>/vllm.log`` that names them: ``max_num_batched_tokens``,
    ``max_num_seqs``) as a calibration's ``batch``; ``None`` when no log says."""
    for log in sorted(out.glob("work/*/vllm.log")):
        with log.open(errors="replace") as f:
            for line in f:
                if m := VLLM_BATCH.search(line):
                    return {"max_seqs": int(m.group(2)), "max_tokens": int(m.group(1))}
    return None


def fit_calibrations(out: Path, doc: dict[str, Any], kv_per_token: int) -> dict[str, Calibration]:
    """Per backend (``none``: the ``prefill`` system; ``kvtierd``; ``lmcache``) its calibration,
    fitted from the measurements in ``out`` and written as ``calibration-<backend>.yaml``: the
    ``prefill`` system's line from its own requests; the cached backends' line from every
    cached system's misses (:func:`miss_samples`: their vLLM may serve in another dtype; at
    one length, behind a shared prefix, through the origin), else (runs without warm-up
    records) from the ``prefill`` system's and theirs; their tiers from
    the hits of :data:`TIER_SOURCE`'s system. A backend whose tiers cannot be fitted is left
    out with a note; ``SystemExit`` when no backend can be."""
    from kvtierd.errors import KvtierError
    from kvtierd.sim.calibration import load_calibration, parse_calibration

    runs = {n: out / f"{n}.json" for n in ("prefill", *TIER_SOURCE.values())}
    if not runs["prefill"].exists():
        raise SystemExit(f"no {runs['prefill']}: run bench_e2e first (at least --systems "
                         "prefill lru), or give --calibration")  # fmt: skip
    lengths = Lengths(doc)
    reference = json.loads(runs["prefill"].read_text())
    docs = (json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p != runs["prefill"])
    cached = [d for d in docs if isinstance(d, dict) and "outcomes" in d]
    own = prefill_samples(reference, lengths)
    misses = miss_samples(cached, lengths)
    if not misses:  # runs without warm-up records (before issue 26) or vLLM's usage
        misses = prefill_samples(reference, lengths, cached)
    tiers = [t["name"] for t in doc["tiers"]]
    parts: dict[str, tuple[list[Service], list[Service], str]] = {}  # prefill, hits, source
    for backend, system in TIER_SOURCE.items():
        if not runs[system].exists():
            continue
        run = json.loads(runs[system].read_text())
        log = out / "work" / system / "vllm.log"
        logged = measured_hits(run, lengths, log)
        if logged is None:
            raise SystemExit(f"{log}: no LMCache hit lines matching {runs[system]}'s requests "
                             "(bench_e2e keeps each system's logs under work/); give "
                             "--calibration")  # fmt: skip
        hits = hit_samples(run, lengths, logged)
        if backend == "kvtierd":
            hits += quantized_hits(out, lengths, doc)
        if len(hits) < 2:
            print(f"  {backend}: {len(hits)} hits in {runs[system]}, too few to fit its tiers; "
                  "not predicted", flush=True)  # fmt: skip
            continue
        parts[backend] = (misses, hits, f"the cached systems' misses in {out} and "
                          f"{runs[system]}'s hits")  # fmt: skip
        if backend == "kvtierd" or "none" not in parts:  # the prefill system needs some tiers
            parts["none"] = (own, hits, str(runs["prefill"]))
    if not parts:
        raise SystemExit(f"no {' or '.join(str(p) for p in list(runs.values())[1:])} with hits "
                         "to calibrate the tiers: run bench_e2e --systems lru, or give "
                         "--calibration")  # fmt: skip
    batch = vllm_batching(out)
    line = parse_calibration(calibration_yaml(*parts["none"][:2], tiers, "", batch=batch), "",
                             kv_per_token)  # fmt: skip
    decode_s = fit_decode_s(reference, lengths, line.prefill, line.batching)
    result = {}
    for backend, (prefill, hits, source) in parts.items():
        text = calibration_yaml(prefill, hits, tiers, source, decode_s=decode_s, batch=batch)
        path = out / f"calibration-{backend}.yaml"
        path.write_text(text)
        try:
            result[backend] = load_calibration(path, kv_per_token)
        except KvtierError as e:
            raise SystemExit(f"cannot calibrate from the measurements: {e}") from e
    return result
