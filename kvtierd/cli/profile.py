"""Profiler commands: ``profile run``, ``profile status`` and ``queries add``.

``profile run`` asks the daemon to profile contexts now (``Admin.Profile``), one context per
request so a terminal shows progress and one failure does not hide the others' results.
``profile status`` shows the profiler's totals and, for one context, each variant's quality
(``Admin.ProfileStatus``). ``queries add`` supplies a context's profiling queries
(``KVStore.AddQueries``, EvicPress §4.1): the next profiling run of the context uses them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvtierd.cli.admin import connect, profile_reading
from kvtierd.cli.exit_codes import CliError, ExitCode
from kvtierd.cli.output import Output, human_bytes, human_duration, to_dict
from kvtierd.rpc import kvtier_pb2 as pb

MAX_QUERIES_PER_REQUEST = 1000  # the daemon's limit per AddQueries request


def run_profile_run(args: argparse.Namespace, out: Output) -> ExitCode:
    results: list[dict[str, Any]] = []
    with connect(args) as conn:
        listed = conn.call(conn.stub.ListContexts, pb.ListContextsRequest()).contexts
        known = [c.context_id for c in listed]
        ids: list[str] = list(dict.fromkeys(args.context_ids)) or known
        missing = sorted(set(ids) - set(known))
        if missing:
            # Checked before profiling anything, as the daemon does for one request.
            raise CliError(ExitCode.NOT_FOUND, f"no such context: {', '.join(missing)}")
        with out.progress("profiling", len(ids)) as step:
            for cid in ids:
                try:
                    r = conn.call(conn.stub.Profile, pb.ProfileRequest(context_ids=[cid]))
                except CliError as e:
                    if e.code is not ExitCode.NOT_FOUND or args.context_ids:
                        raise
                    r = None  # evicted since it was listed: nothing left to profile
                step(cid)
                if r is not None:
                    error = "; ".join(r.errors)
                    results.append({"context_id": cid, "ok": r.profiled > 0, "error": error})
    ok = sum(r["ok"] for r in results)
    failed = len(results) - ok
    summary = {
        "requested": len(ids),
        "profiled": ok,
        "failed": failed,
        "errors": [r["error"] for r in results if not r["ok"]],
        "contexts": results,
    }
    if out.as_json:
        out.json(summary)
    else:
        if results:
            out.table(
                "profiling runs",
                ("context", "result", "error"),
                [(r["context_id"], "profiled" if r["ok"] else "FAILED", r["error"])
                 for r in results],
            )  # fmt: skip
        out.line(f"profiled {ok} of {len(ids)} contexts" + (f", {failed} failed" if failed else ""))
    return ExitCode.ERROR if failed else ExitCode.OK


_TOTALS = ("evaluator", "runs_ok", "runs_failed", "reprofiled", "last_error")


def run_profile_status(args: argparse.Namespace, out: Output) -> ExitCode:
    cid = args.context_id or ""
    with connect(args) as conn:
        r = conn.call(conn.stub.ProfileStatus, pb.ProfileStatusRequest(context_id=cid))
    doc = to_dict(r)
    if out.as_json:
        out.json({"context_id": cid, **doc} if cid else {k: doc[k] for k in _TOTALS})
        return ExitCode.OK
    out.fields(
        "profiler",
        [
            ("evaluator", r.evaluator or "-"),
            ("runs", f"{r.runs_ok} ok, {r.runs_failed} failed"),
            ("re-profiled on drift", r.reprofiled),
            ("last error", r.last_error or "-"),
        ],
    )
    if not cid:
        return ExitCode.OK
    upcoming = [
        ("next profile's queries", f"{r.next_num_queries} ({r.next_query_source or '-'})"),
        ("token ids registered", r.known_tokens),
    ]
    if not r.profiled:
        out.fields(f"context {cid}", [("profiled", "not yet"), *upcoming])
        out.line(f"profile it now: kvtierctl profile run {cid}")
        return ExitCode.OK
    trusted = "yes" if r.trusted else (
        f"no: fewer than profiling.min_queries {r.min_queries}, not each asked twice in that "
        "many requests; the placer treats the context as unprofiled until a profile from "
        "enough queries"
    )  # fmt: skip
    out.fields(
        f"context {cid}",
        [
            ("profiled", profile_reading(r.reading, r.profile_evaluator, r.profiled_age_s)),
            ("queries", f"{r.num_queries} ({r.query_source or '-'})"),
            ("moves the context", trusted),
            *upcoming,
        ],
    )
    out.table(
        "variants by quality",
        ("variant", "size", "quality", "restore"),
        [
            (v.variant, human_bytes(v.size_bytes), f"{v.quality:.3f}",
             human_duration(v.restore_s) if v.restore_s else "-")
            for v in sorted(r.variants, key=lambda v: (-v.quality, v.size_bytes))
        ],
    )  # fmt: skip
    return ExitCode.OK


def _read_queries(path: str) -> list[str]:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(ExitCode.INVALID, f"cannot read queries file {path}: {e}") from e
    return [line.strip() for line in text.splitlines() if line.strip()]


def run_queries_add(args: argparse.Namespace, out: Output) -> ExitCode:
    texts = [t for t in args.texts if t.strip()]
    if args.from_file:
        texts += _read_queries(args.from_file)
    if not texts:
        raise CliError(ExitCode.USAGE, "no queries: give TEXT arguments or --from-file FILE")
    batches = [
        texts[i : i + MAX_QUERIES_PER_REQUEST]
        for i in range(0, len(texts), MAX_QUERIES_PER_REQUEST)
    ]
    stored = 0
    with connect(args) as conn, out.progress("adding queries", len(batches)) as step:
        for batch in batches:
            req = pb.AddQueriesRequest(
                context_id=args.context_id, texts=batch, from_traffic=args.from_traffic
            )
            stored += conn.call(conn.kv.AddQueries, req).stored
            step(f"{stored} stored")
    if out.as_json:
        out.json({"context_id": args.context_id, "requested": len(texts), "stored": stored})
    else:
        kind = "traffic samples" if args.from_traffic else "profiling queries"
        out.line(
            f"stored {stored} of {len(texts)} {kind} for {args.context_id}; used from its next "
            f"profiling run (kvtierctl profile run {args.context_id})"
        )
    return ExitCode.OK
