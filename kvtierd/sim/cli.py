"""``kvtierd sim``: the simulator's one command line (docs/simulator.md).

Subcommands: ``run`` (one placer), ``sweep`` (EvicPress over alphas + every baseline, the
headline table), ``report`` (the sweep's figures and ``results.json``), ``predict`` (a measured
stack's TTFT for a given workload, from a calibration). No daemon is involved:
the simulator replays a workload through the placers in this process. Output and exit codes
are kvtierctl's (a table, or one JSON document with ``--json``; 2 bad command line, 5 invalid
input; errors are one line on stderr).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence

from kvtierd.cli.exit_codes import CliError, ExitCode
from kvtierd.cli.output import Output
from kvtierd.sim import commands, options, predict, report

logger = logging.getLogger(__name__)

Handler = Callable[[argparse.Namespace, Output], ExitCode]


def _command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, run: Handler, help: str
) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=help)
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(run=run)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtierd sim",
        description="Simulate placers on a workload: TTFT, quality, hit rates (no daemon).",
        epilog="exit codes: 0 ok, 1 error, 2 usage, 5 invalid input (docs/simulator.md)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = _command(sub, "run", commands.run_one, "replay the workload through one placer")
    options.add_placer_args(p)
    options.add_workload_args(p)
    p = _command(
        sub,
        "sweep",
        commands.run_sweep_command,
        "EvicPress at every --alphas value and every baseline; the headline table",
    )
    options.add_placer_args(p)
    options.add_workload_args(p)
    options.add_sweep_args(p)
    p = _command(
        sub,
        "report",
        report.run_report,
        "the sweep, then PNG plots (Fig. 7, 8, 11) and results.json",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the PNGs and JSON")
    options.add_placer_args(p)
    options.add_workload_args(p)
    options.add_sweep_args(p)
    p = _command(
        sub,
        "predict",
        predict.run_predict,
        "a measured stack's TTFT for a given workload, from a calibration",
    )
    p.add_argument("--workload", required=True, metavar="JSON", help="the requests sent")
    p.add_argument("--calibration", required=True, metavar="YAML", help="what was measured")
    options.add_placer_args(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING)
    out = Output(as_json=args.json, prog="kvtierd sim")
    try:
        return int(args.run(args, out))
    except CliError as e:
        if args.debug:
            logger.exception("kvtierd sim failed")
        out.error(e.message)
        return int(e.code)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvtierd sim ... | head` closed our stdout
        return int(ExitCode.OK)
