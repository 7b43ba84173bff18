"""The writer of ``test_crash.py``, in its own process: durable puts until the daemon dies.

    python -m tests.daemon.crash_writer SOCKET CYCLE [--stream]

Prints ``try KEY`` before each put and ``ack KEY`` once the daemon acknowledged it, flushed
line by line; the test reads them after SIGKILLing the daemon. It runs apart from the test's
process because grpcio 1.78's sync client can abort its whole process when the server dies
during a client-streaming call (docs/daemon.md, "Crash safety"): the daemon's crash safety is
what the test checks, and a client library's crash must not take the test run with it.
"""

from __future__ import annotations

import sys

from benchmarks._support.workload import payload, size_of
from kvtierd import errors
from kvtierd.client import KVClient

PUTS_PER_CYCLE = 400  # at most ~400 MiB a cycle: the test's 4 GiB SSD tier never has to evict


def main(argv: list[str]) -> int:
    socket_path, cycle, stream = argv[0], int(argv[1]), "--stream" in argv[2:]
    with KVClient(socket_path, timeout_s=10, stream=stream) as c:
        for i in range(PUTS_PER_CYCLE):
            key = f"c{cycle}-{i}"
            print("try", key, flush=True)
            try:
                c.put(key, payload(key, size_of(key)), durable=True)
            except errors.KvtierError:
                return 0  # the daemon died under us: this put was not acknowledged
            print("ack", key, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
