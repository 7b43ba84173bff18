"""Admin commands: status, tiers, contexts ls/show, evict, pin/unpin, drain, rebalance.

Each command is ``run_<name>(args, out) -> ExitCode``: one or two Admin RPCs, then a table or
the JSON of the response.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from kvtierd.cli.connection import AdminConnection, Target
from kvtierd.cli.context_tree import as_tree, drawn
from kvtierd.cli.exit_codes import CliError, ExitCode
from kvtierd.cli.output import (
    Output,
    human_bytes,
    human_duration,
    human_rate,
    human_seconds,
    to_dict,
)
from kvtierd.client.common import advise_request
from kvtierd.config import parse_size
from kvtierd.errors import ConfigError
from kvtierd.rpc import kvtier_pb2 as pb

SERVER_ORDERS = ("recency", "frequency", "size", "id")
CLIENT_ORDERS = ("hits", "tier", "variant")
_CLIENT_KEYS: dict[str, Callable[[pb.ContextSummary], Any]] = {
    "hits": lambda c: -c.hits,
    "tier": lambda c: c.tier,
    "variant": lambda c: c.variant,
}


def connect(args: argparse.Namespace) -> AdminConnection:
    target = Target.resolve(
        socket=args.socket,
        address=args.address,
        tls_ca=args.tls_ca,
        token=args.token,
        token_file=args.token_file,
        timeout_s=args.timeout,
    )
    return AdminConnection(target)


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def durable_state(c: pb.ContextSummary) -> str:
    """``3 unread``: durable objects not read yet, which the placer may not drop; ``held``:
    the placer dropped the context and the daemon keeps them (docs/daemon.md, durable)."""
    if not c.durable_unread:
        return ""
    held = ", held (placer dropped it)" if c.durable_held else ""
    return f"{c.durable_unread} unread{held}"


def profile_reading(reading: str, evaluator: str, age_s: float) -> str:
    """``first put (query_attention), 3.0 min ago``: which reading made a context's profile
    (docs/profiler.md, "Readings"), by which evaluator, and when."""
    return f"{reading} ({evaluator}), {human_seconds(age_s)} ago"


def run_status(args: argparse.Namespace, out: Output) -> ExitCode:
    with connect(args) as conn:
        s = conn.call(conn.stub.Status, pb.StatusRequest())
    code = ExitCode.OK if s.health == "SERVING" and not s.draining else ExitCode.BUSY
    if out.as_json:
        out.json({**to_dict(s), "hit_rate": _ratio(s.hits, s.hits + s.misses)})
        return code
    out.fields(
        f"kvtierd {s.version} at {conn.target.uri}",
        [
            ("health", s.health + (" (draining)" if s.draining else "")),
            ("uptime", human_seconds(s.uptime_s)),
            ("instance", s.instance_id),
            ("placer", s.placer),
            ("contexts", s.contexts),
            ("objects", s.objects),
            ("leases", s.leases),
            ("allocations", s.allocations),
            ("lookups", _lookups(s)),
            ("chunks hit / missed", f"{s.hits} / {s.misses}"),
            ("hit rate", f"{_ratio(s.hits, s.hits + s.misses):.1%} of chunks"),
            ("durable holds", s.durable_holds),
            ("prefill", _prefill(s)),
            ("quality profiles", quality_profiles(s.quality, s.placer)),
        ],
    )
    return code


def _lookups(s: pb.StatusResponse) -> str:
    """Served requests' lookups by outcome: ``6 (3 hit, 2 partial, 1 missed)``."""
    total = s.lookups_hit + s.lookups_partial + s.lookups_missed
    return (f"{total} ({s.lookups_hit} hit, {s.lookups_partial} partial, "
            f"{s.lookups_missed} missed)")  # fmt: skip


NO_MODEL_LINE = (
    "no model — token-dropping variants from each context's coverage where its token ids are "
    "registered, the rest from the prior (set profiling.model_dir)"
)


def quality_profiles(q: pb.QualityProfiling, placer: str) -> str:
    """What the daemon's profiles read (docs/profiler.md, "Readings"); without a model, what
    it falls back to and what to set."""
    if not q.estimator:
        return f"not used (placer {placer} does not place by quality)"
    if q.prior_only:
        return NO_MODEL_LINE
    made = q.estimator + (f", refined by {q.refiner}" if q.refiner else "")
    if not q.model_dir:
        return f"{made}, without a model"
    return f"{made} with model {q.model_dir}" + (
        " (model cache)" if q.model_dir_from == "model cache" else ""
    )


def _prefill(s: pb.StatusResponse) -> str:
    rate = f"{s.prefill_tokens_per_s:,.0f} tokens/s"
    if not s.prefill_learned:
        return f"{rate} (configured; {s.prefill_samples} prefill samples from served requests)"
    return (f"{rate} + {s.prefill_overhead_s:.2f} s per request (learned from "
            f"{s.prefill_samples} served requests)")  # fmt: skip


def run_tiers(args: argparse.Namespace, out: Output) -> ExitCode:
    with connect(args) as conn:
        tiers = conn.call(conn.stub.ListTiers, pb.ListTiersRequest()).tiers
        s = conn.call(conn.stub.Status, pb.StatusRequest())
    lookups = s.hits + s.misses
    if out.as_json:
        out.json([{**to_dict(t), "hit_rate": _ratio(t.hits, lookups)} for t in tiers])
    else:
        rows = [
            (
                t.name,
                t.kind,
                human_bytes(t.capacity_bytes) if t.capacity_bytes else "unbounded",
                human_bytes(t.used_bytes),
                f"{_ratio(t.used_bytes, t.capacity_bytes):.0%}" if t.capacity_bytes else "-",
                t.object_count,
                human_rate(t.read_bandwidth_bytes_per_s),
                human_duration(t.read_overhead_s),
                human_rate(t.write_bandwidth_bytes_per_s),
                f"{_ratio(t.hits, lookups):.1%}",
                "yes" if t.healthy else "NO",
                t.detail,
            )
            for t in tiers
        ]
        cols = ("name", "kind", "capacity", "used", "use", "objects", "read", "read overhead",
                "write", "hit rate", "healthy", "detail")  # fmt: skip
        out.table("tiers (fastest first)", cols, rows)
    return ExitCode.OK if all(t.healthy for t in tiers) else ExitCode.BUSY


def _filtered(contexts: list[pb.ContextSummary], args: argparse.Namespace) -> list[Any]:
    keep = contexts
    if args.pinned is not None:
        keep = [c for c in keep if c.pinned == args.pinned]
    if args.variant:
        keep = [c for c in keep if c.variant == args.variant]
    if args.dropped:
        keep = [c for c in keep if not c.tier]
    if args.sort in _CLIENT_KEYS:
        keep = sorted(keep, key=_CLIENT_KEYS[args.sort])
    if args.reverse:
        keep = keep[::-1]
    return keep[: args.limit] if args.limit else keep


def run_contexts_ls(args: argparse.Namespace, out: Output) -> ExitCode:
    # The daemon filters by tier and sorts by its orders; everything else happens here, so the
    # limit is applied here too whenever a local filter or order could change which rows count.
    local = (
        args.pinned is not None or args.variant or args.dropped or args.reverse
        or args.sort in _CLIENT_KEYS
    )  # fmt: skip
    request = pb.ListContextsRequest(
        tier=args.tier or "",
        limit=0 if local else args.limit,
        order_by=args.sort if args.sort in SERVER_ORDERS else "recency",
    )
    with connect(args) as conn:
        contexts = list(conn.call(conn.stub.ListContexts, request).contexts)
    rows = _filtered(contexts, args)
    if out.as_json:
        out.json([to_dict(c) for c in rows])
        return ExitCode.OK
    out.table(
        f"{len(rows)} contexts (a child is drawn under the context it continues)",
        ("context", "variant", "tier", "size", "objects", "hits", "frequency", "idle", "pinned",
         "durable"),
        [
            (
                drawn(depth, c.context_id), c.variant, c.tier or "(dropped)",
                human_bytes(c.size_bytes), c.objects, c.hits, f"{c.frequency:.3g}",
                human_seconds(c.last_access_age_s), "pinned" if c.pinned else "",
                durable_state(c),
            )
            for depth, c in as_tree(rows)
        ],
    )  # fmt: skip
    return ExitCode.OK


def run_contexts_show(args: argparse.Namespace, out: Output) -> ExitCode:
    with connect(args) as conn:
        req = pb.DescribeContextRequest(context_id=args.context_id)
        d = conn.call(conn.stub.DescribeContext, req)
    if out.as_json:
        out.json(to_dict(d))
        return ExitCode.OK
    s = d.summary
    out.fields(
        f"context {s.context_id}",
        [
            ("placement", f"{s.variant} in {s.tier}" if s.tier else f"{s.variant} (dropped)"),
            ("size", human_bytes(s.size_bytes)),
            ("objects", s.objects),
            ("hits", s.hits),
            ("frequency", f"{s.frequency:.3g}"),
            ("idle", human_seconds(s.last_access_age_s)),
            ("pinned", "yes" if s.pinned else "no"),
            ("durable", durable_state(s) or "-"),
            ("profile", profile_reading(d.profile.reading, d.profile.evaluator,
                                        d.profile.age_s)
             if d.HasField("profile") else "not profiled"),
            ("why", d.reason or "-"),
            ("ancestors", " > ".join(d.ancestors) or "- (a root)"),
            ("children", s.children),
            ("token dropping", f"refused: {s.token_drop_refused}" if s.token_drop_refused
             else "allowed"),
        ],
    )  # fmt: skip
    if d.descendants:
        out.table(
            "descendants (each under the context it continues)",
            ("context", "variant", "tier", "size", "frequency"),
            [
                (drawn(depth, c.context_id), c.variant, c.tier or "(dropped)",
                 human_bytes(c.size_bytes), f"{c.frequency:.3g}")
                for depth, c in as_tree([s, *d.descendants])[1:]
            ],
        )  # fmt: skip
    if d.options:
        out.table(
            "utility of each configuration",
            ("variant", "tier", "size", "quality", "ttft", "utility", "chosen"),
            [_option_row(o, s) for o in sorted(d.options, key=lambda o: -o.utility)],
        )
    out.table(
        "objects",
        ("key", "variant", "tier", "size", "dtype", "tokens"),
        [
            (o.spec.key, o.spec.variant or "none", o.tier, human_bytes(o.spec.size_bytes),
             o.spec.dtype, o.spec.token_count)
            for o in d.objects
        ],
    )  # fmt: skip
    return ExitCode.OK


def run_contexts_advise(args: argparse.Namespace, out: Output) -> ExitCode:
    if args.tokens < 0:
        raise CliError(ExitCode.USAGE, f"--tokens must be >= 0, got {args.tokens}")
    try:
        size = parse_size(args.size, "--size")
    except ConfigError as e:
        raise CliError(ExitCode.USAGE, str(e)) from e
    request = advise_request(args.context_id, args.tokens, size)
    with connect(args) as conn:
        (advice,) = conn.call(conn.kv.Advise, request).advice
    if out.as_json:
        out.json(to_dict(advice))
        return ExitCode.OK
    out.fields(
        f"write advice for {advice.context_id}",
        [
            ("variant", advice.variant),
            ("tier", advice.tier or "-"),
            ("source", advice.source),
            ("why", advice.reason),
        ],
    )
    return ExitCode.OK


def run_contexts_plan(args: argparse.Namespace, out: Output) -> ExitCode:
    """``contexts plan``: ``contexts advise`` under its name before issue 17, kept one release."""
    out.note("`contexts plan` is deprecated: it is `contexts advise` now (same options and output)")
    return run_contexts_advise(args, out)


def _option_row(o: pb.PlacementOption, s: pb.ContextSummary) -> tuple[object, ...]:
    chosen = o.variant == s.variant and o.tier == s.tier
    return (
        o.variant, o.tier or "(dropped)", human_bytes(o.size_bytes), f"{o.quality:.3f}",
        human_duration(o.ttft_s), f"{o.utility:.4g}", "<-" if chosen else "",
    )  # fmt: skip


def run_evict(args: argparse.Namespace, out: Output) -> ExitCode:
    with connect(args) as conn, out.working("evicting"):
        r = conn.call(conn.stub.Evict, pb.EvictRequest(context_ids=args.context_ids))
    return _count(out, {"evicted": r.evicted, "requested": len(args.context_ids)}, "evicted")


def run_pin(args: argparse.Namespace, out: Output) -> ExitCode:
    req = pb.PinRequest(context_ids=args.context_ids)
    with connect(args) as conn:
        method = conn.stub.Pin if args.command == "pin" else conn.stub.Unpin
        r = conn.call(method, req)
    verb = "pinned" if args.command == "pin" else "unpinned"
    return _count(out, {"changed": r.changed, "requested": len(args.context_ids)}, verb)


def _count(out: Output, result: dict[str, int], verb: str) -> ExitCode:
    if out.as_json:
        out.json(result)
    else:
        first = next(iter(result.values()))
        out.line(f"{verb} {first} of {result['requested']} contexts")
    return ExitCode.OK


def run_drain(args: argparse.Namespace, out: Output) -> ExitCode:
    with connect(args) as conn, out.working(f"draining tier {args.tier}"):
        r = conn.call(conn.stub.Drain, pb.DrainRequest(tier=args.tier))
    if out.as_json:
        out.json(to_dict(r))
    else:
        out.line(f"drained {args.tier}: {r.moved} contexts moved down, {r.dropped} dropped")
    return ExitCode.OK


def run_rebalance(args: argparse.Namespace, out: Output) -> ExitCode:
    with connect(args) as conn, out.working("rebalancing"):
        r = conn.call(conn.stub.Rebalance, pb.RebalanceRequest())
    if out.as_json:
        out.json(to_dict(r))
    else:
        out.line(
            f"rebalanced: {r.operations} operations ({r.moved} moved, {r.compressed} "
            f"compressed, {r.dropped} dropped)"
        )
    return ExitCode.OK
