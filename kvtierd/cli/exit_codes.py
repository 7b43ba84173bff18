"""kvtierctl exit codes and the one exception commands raise to end with one of them.

Scripts branch on these (docs/kvtierctl.md lists them):

====  =============  ===========================================================================
code  name           meaning
====  =============  ===========================================================================
0     OK             done
1     ERROR          the daemon failed the request (INTERNAL, DATA_LOSS, ...) or an unexpected error
2     USAGE          bad command line (argparse)
3     UNREACHABLE    no daemon answers at the socket/address
4     NOT_FOUND      no such context, tier or object
5     INVALID        invalid input: a bad policy or model file, INVALID_ARGUMENT, ALREADY_EXISTS
6     DENIED         UNAUTHENTICATED or PERMISSION_DENIED (token)
7     BUSY           the daemon cannot do it now: UNAVAILABLE (draining, tier down),
                     RESOURCE_EXHAUSTED, FAILED_PRECONDITION, DEADLINE_EXCEEDED, ABORTED
====  =============  ===========================================================================
"""

from __future__ import annotations

import enum

from kvtierd.errors import KvtierError, status_name


class ExitCode(enum.IntEnum):
    OK = 0
    ERROR = 1
    USAGE = 2
    UNREACHABLE = 3
    NOT_FOUND = 4
    INVALID = 5
    DENIED = 6
    BUSY = 7


class CliError(Exception):
    """Ends the command with ``code`` after printing ``message`` as one line on stderr."""

    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# gRPC status (by name) -> exit code; any other status is ERROR.
EXIT_OF_STATUS: dict[str, ExitCode] = {
    "NOT_FOUND": ExitCode.NOT_FOUND,
    "INVALID_ARGUMENT": ExitCode.INVALID,
    "ALREADY_EXISTS": ExitCode.INVALID,
    "OUT_OF_RANGE": ExitCode.INVALID,
    "UNAUTHENTICATED": ExitCode.DENIED,
    "PERMISSION_DENIED": ExitCode.DENIED,
    "UNAVAILABLE": ExitCode.BUSY,
    "RESOURCE_EXHAUSTED": ExitCode.BUSY,
    "FAILED_PRECONDITION": ExitCode.BUSY,
    "DEADLINE_EXCEEDED": ExitCode.BUSY,
    "ABORTED": ExitCode.BUSY,
}


def exit_code_of(error: KvtierError) -> ExitCode:
    """The exit code of a domain error: that of the status the daemon answers it with."""
    return EXIT_OF_STATUS.get(status_name(error), ExitCode.ERROR)
