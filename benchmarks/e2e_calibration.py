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

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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
    warm = [lengths.service(o, o["ttft_s"]) for o in measured.get("warmup", []) if not o["error"]]
    runs = [(measured["outcomes"], {o["index"] for o in measured["outcomes"]})]
    for run in others:
        misses = {o["index"] for o in run["outcomes"]
                  if o.get("cached_tokens", -1) == 0 and not o["served_from"]}  # fmt: skip
        runs.append((run["outcomes"], misses))
    return warm + _fit_samples(runs, lengths)


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
    prefill: list[Service], hits: list[Service], tiers: list[str], source: str
) -> str:
    """A calibration document (``kvtierd/sim/calibration.py``'s format) with its provenance."""
    import yaml

    doc: dict[str, Any] = {
        "prefill": {"samples": [s.row() for s in prefill]},
        "decode_s": 0.0,
        "tiers": [{"name": t, "samples": [s.row() for s in hits]} for t in tiers],
    }
    if len({s.context_tokens for s in hits}) < 2:  # one length: no overhead can be told apart
        doc["tiers"] = [t | {"overhead_s": 0.0} for t in doc["tiers"]]
    doc |= {"quality": {}}
    head = (
        f"# Fitted by benchmarks/sim_e2e.py from {source} (benchmarks/e2e_calibration.py):\n"
        f"# prefill: {len(prefill)} requests (the prefill system's, other systems' misses); "
        f"tiers: {len(hits)} hits\n# (vLLM's usage or LMCache's log), the same samples for "
        "every tier (neither says which).\n# Each as measured where it ran alone, else as "
        "estimated. Samples: [context tokens, service s, query tokens].\n"
        "# decode_s 0: vLLM interleaves decoding with the next prefill.\n"
    )
    return head + yaml.safe_dump(doc, default_flow_style=None, sort_keys=False, width=100)
