"""``policy show | validate FILE | apply FILE``: read, check and hot-reload placement policies.

``validate`` needs no daemon: it runs the same ``parse_policy`` the daemon runs and checks that
this installation has the named placer. ``apply`` validates locally first (so a typo is reported
with its line before any connection is made), then sends the document; the daemon validates it
again and swaps it in whole, or keeps the running policy and answers INVALID_ARGUMENT.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvtierd.cli.admin import connect
from kvtierd.cli.exit_codes import CliError, ExitCode
from kvtierd.cli.output import Output, to_dict
from kvtierd.errors import ConfigError
from kvtierd.policies import placer_class
from kvtierd.policies.loader import parse_policy
from kvtierd.policy_config import PolicyConfig
from kvtierd.rpc import kvtier_pb2 as pb


def read_policy(path: str) -> tuple[str, PolicyConfig]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise CliError(ExitCode.INVALID, f"cannot read policy file {path}: {e.strerror}") from e
    try:
        policy = parse_policy(text, path)
    except ConfigError as e:
        raise CliError(ExitCode.INVALID, str(e)) from e
    return text, policy


def summary(policy: PolicyConfig) -> dict[str, object]:
    """What a policy sets, for tables and ``--json``: the common keys, then the attributes its
    placer reads (``Placer.policy_fields``); the grid as its number of variants."""
    out: dict[str, object] = {
        "name": policy.name,
        "placer": policy.placer,
        "source": policy.source,
        "description": policy.description,
    }
    for attr in placer_class(policy.placer).policy_fields:
        value = getattr(policy, attr)
        out[attr] = len(value) if attr == "variants" else _plain(value)
    return out


def _plain(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


def run_validate(args: argparse.Namespace, out: Output) -> ExitCode:
    _, policy = read_policy(args.file)
    info = summary(policy)
    if out.as_json:
        out.json({"valid": True, **info})
    else:
        out.fields(f"{args.file}: valid", [(k, _show(v)) for k, v in info.items()])
    return ExitCode.OK


def _show(value: object) -> str:
    if isinstance(value, list):
        return ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
    return str(value)


def run_apply(args: argparse.Namespace, out: Output) -> ExitCode:
    text, policy = read_policy(args.file)
    request = pb.ApplyPolicyRequest(yaml=text, source=args.file, dry_run=args.dry_run)
    with connect(args) as conn, out.working(f"applying {policy.name}"):
        r = conn.call(conn.stub.ApplyPolicy, request)
    if out.as_json:
        out.json({**to_dict(r), "applied": not args.dry_run})
    elif args.dry_run:
        out.line(f"{args.file}: the daemon accepts policy {r.name!r} (dry run, nothing changed)")
    else:
        out.line(f"policy {r.name!r} from {r.source} is now running")
    return ExitCode.OK


def run_show(args: argparse.Namespace, out: Output) -> ExitCode:
    with connect(args) as conn:
        r = conn.call(conn.stub.GetPolicy, pb.PolicyRequest())
    if out.as_json:
        out.json(to_dict(r))
        return ExitCode.OK
    out.line(f"[bold]{r.name}[/bold] from {r.source}")
    out.line("")
    out.console.print(r.yaml.rstrip("\n"), markup=False, highlight=False)
    return ExitCode.OK
