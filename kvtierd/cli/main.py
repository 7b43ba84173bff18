"""``kvtierctl``: operate a running kvtierd through its Admin gRPC service.

Every command prints a rich table for people or, with ``--json``, one JSON document for
scripts; exit codes are listed in :mod:`kvtierd.cli.exit_codes` and docs/kvtierctl.md.
Errors are one line on stderr, never a traceback (``--debug`` shows it).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from kvtierd.cli import admin, bench, kvsize, policy, profile
from kvtierd.cli.exit_codes import CliError, ExitCode
from kvtierd.cli.output import Output

logger = logging.getLogger(__name__)

Handler = Callable[[argparse.Namespace, Output], ExitCode]


def _common(parser: argparse.ArgumentParser, top: bool) -> None:
    """Options accepted before and after the command (``kvtierctl --json status`` and
    ``kvtierctl status --json``); subcommand copies default to SUPPRESS so they never
    overwrite a value given before the command."""

    def d(value: object) -> object:
        return value if top else argparse.SUPPRESS

    g = parser.add_argument_group("connection and output")
    g.add_argument("--json", action="store_true", default=d(False), help="print JSON")
    g.add_argument(
        "--socket",
        default=d(None),
        help="daemon Unix socket (default: $KVTIERD_SOCKET or the runtime dir)",
    )
    g.add_argument("--address", default=d(None), help="HOST:PORT: use TCP with TLS instead")
    g.add_argument("--tls-ca", default=d(None), help="CA certificate for --address (PEM)")
    g.add_argument("--token", default=d(None), help="bearer token (default: $KVTIERD_TOKEN)")
    g.add_argument("--token-file", default=d(None), help="read the bearer token from a file")
    g.add_argument("--timeout", type=float, default=d(120.0), help="seconds per request")
    g.add_argument("--debug", action="store_true", default=d(False),
                   help="show tracebacks and debug logs")  # fmt: skip


def _command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    run: Handler,
    help: str,
    *,
    listed: bool = True,
) -> argparse.ArgumentParser:
    """A subcommand; ``listed=False`` leaves it out of its parent's help (a deprecated name:
    argparse prints ``help=SUPPRESS`` as the text ``==SUPPRESS==`` before Python 3.13)."""
    if listed:
        p = sub.add_parser(name, help=help, description=help)
    else:
        p = sub.add_parser(name, description=help)
    _common(p, top=False)
    p.set_defaults(run=run)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtierctl",
        description="Operate a running kvtierd (multi-tier KV-cache manager).",
        epilog="exit codes: 0 ok, 1 error, 2 usage, 3 daemon unreachable, 4 not found, "
        "5 invalid input, 6 denied, 7 daemon busy/unhealthy (docs/kvtierctl.md)",
    )
    _common(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _command(sub, "status", admin.run_status, "daemon health, uptime, counts, hit rate")
    _command(sub, "tiers", admin.run_tiers, "capacity, use, bandwidth and hit rate per tier")
    _contexts(sub)
    for name, verb in (("evict", "drop"), ("pin", "pin"), ("unpin", "unpin")):
        run = admin.run_evict if name == "evict" else admin.run_pin
        p = _command(sub, name, run, f"{verb} contexts (by context id)")
        p.add_argument("context_ids", nargs="+", metavar="CONTEXT_ID")
    p = _command(sub, "drain", admin.run_drain, "move everything out of a tier (down, or drop)")
    p.add_argument("tier")
    _command(sub, "rebalance", admin.run_rebalance, "recompute every placement now")
    _policy(sub)
    _profiler(sub)
    p = _command(sub, "kv-size", kvsize.run_kv_size, "KV-cache bytes of a context, per variant")
    p.add_argument("model", metavar="MODEL_DIR_OR_PRESET",
                   help=f"a directory with config.json, or one of: "
                   f"{', '.join(g.name for g in kvsize.PRESETS.values())}")  # fmt: skip
    p.add_argument("--tokens", type=int, required=True, help="context length in tokens")
    p.add_argument("--dtype", help="override the KV dtype (default: the model's)")
    p.add_argument("--variant", action="append", help="a variant to size (repeatable)")
    p.add_argument("--policy", help="size every variant of this policy file's grid")
    p = _command(
        sub,
        "bench",
        bench.run_bench,
        "put + get through the daemon vs memcpy, measured in the same run",
    )
    p.add_argument("--mib", type=int, default=64, help="object size in MiB (default 64)")
    p.add_argument("--repeat", type=int, default=5, help="best of this many runs (default 5)")
    p.add_argument(
        "--stream",
        action="store_true",
        help="also measure the gRPC stream path (KVClient(socket, stream=True))",
    )
    return parser


def _contexts(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ctx = sub.add_parser("contexts", help="list cached contexts, show one, or advise its form")
    csub = ctx.add_subparsers(dest="contexts_command", required=True, metavar="ls|show|advise")
    p = _command(csub, "ls", admin.run_contexts_ls, "list contexts (sortable, filterable)")
    p.add_argument("--tier", help="only contexts placed in this tier")
    p.add_argument(
        "--sort",
        default="recency",
        choices=(*admin.SERVER_ORDERS, *admin.CLIENT_ORDERS),
        help="order (default: most recent first)",
    )
    p.add_argument("--reverse", action="store_true", help="reverse the order")
    p.add_argument("--limit", type=int, default=0, help="at most this many rows (0: all)")
    p.add_argument("--variant", help="only contexts stored as this variant")
    p.add_argument("--dropped", action="store_true", help="only dropped contexts")
    pin = p.add_mutually_exclusive_group()
    pin.add_argument("--pinned", dest="pinned", action="store_const", const=True, default=None)
    pin.add_argument("--unpinned", dest="pinned", action="store_const", const=False)
    p = _command(
        csub, "show", admin.run_contexts_show, "variants, utility table, placement and why"
    )
    p.add_argument("context_id")
    advise = "the variant a writer should store it in (the daemon's write advice)"
    renamed = "deprecated: the name of `contexts advise` before it was renamed, kept one release"
    for name, run, help in (
        ("advise", admin.run_contexts_advise, advise),
        ("plan", admin.run_contexts_plan, renamed),
    ):
        p = _command(csub, name, run, help, listed=name == "advise")
        p.add_argument("context_id")
        p.add_argument("--tokens", type=int, default=0, help="its length, for a context not held")
        p.add_argument("--size", default="0", help="its original KV bytes (e.g. 64MiB)")


def _policy(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    pol = sub.add_parser("policy", help="show, validate or hot-reload the placement policy")
    psub = pol.add_subparsers(dest="policy_command", required=True, metavar="show|validate|apply")
    _command(psub, "show", policy.run_show, "the running policy")
    p = _command(psub, "validate", policy.run_validate, "check a policy file (no daemon needed)")
    p.add_argument("file")
    p = _command(psub, "apply", policy.run_apply, "hot-reload a policy file into the daemon")
    p.add_argument("file")
    p.add_argument("--dry-run", action="store_true", help="let the daemon validate only")


def _profiler(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    prof = sub.add_parser("profile", help="run the quality profiler now, or show its results")
    psub = prof.add_subparsers(dest="profile_command", required=True, metavar="run|status")
    p = _command(psub, "run", profile.run_profile_run, "profile contexts now (all when none given)")
    p.add_argument("context_ids", nargs="*", metavar="CONTEXT_ID")
    p = _command(
        psub, "status", profile.run_profile_status,
        "profiler totals; with a context: its variants' size, quality and restore time",
    )  # fmt: skip
    p.add_argument("context_id", nargs="?", metavar="CONTEXT_ID")
    q = sub.add_parser("queries", help="supply a context's profiling queries")
    qsub = q.add_subparsers(dest="queries_command", required=True, metavar="add")
    p = _command(qsub, "add", profile.run_queries_add, "add profiling queries to a context")
    p.add_argument("context_id", metavar="CONTEXT_ID")
    p.add_argument("texts", nargs="*", metavar="TEXT", help="one query per argument")
    p.add_argument("--from-file", metavar="FILE",
                   help="also one query per non-empty line of FILE (- for stdin)")  # fmt: skip
    p.add_argument(
        "--from-traffic",
        action="store_true",
        help="record them as samples of real traffic (drift detection) instead of a user set",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING)
    out = Output(as_json=args.json)
    try:
        return int(args.run(args, out))
    except CliError as e:
        if args.debug:
            logger.exception("kvtierctl failed")
        out.error(e.message)
        return int(e.code)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvtierctl ... | head` closed our stdout
        return int(ExitCode.OK)


if __name__ == "__main__":
    sys.exit(main())
