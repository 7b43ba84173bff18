"""SIGKILL the daemon while durable puts are being written to SSD, many times; after each
restart every acknowledged object must be intact and nothing partial may be served. Both put
paths: the shared-memory arena, and the stream every TCP client takes (where ``durable`` was
once dropped: issue 16.1).

The writer runs in its own process (``crash_writer.py``): grpcio 1.78's sync client can abort
the process it runs in when the server dies mid-call (docs/daemon.md, "Crash safety"), and in
the test's own process that aborted the whole test run about one run in three."""

from __future__ import annotations

import random
import subprocess
import sys
import threading

import pytest

from benchmarks._support.daemon_proc import REPO
from benchmarks._support.workload import payload, size_of
from kvtierd.client import KVClient

CYCLES = 6


class Writer:
    """``crash_writer.py`` in a child process, its output lines read as they come."""

    def __init__(self, socket_path: str, cycle: int, stream: bool) -> None:
        args = [sys.executable, "-m", "tests.daemon.crash_writer", socket_path, str(cycle)]
        self.proc = subprocess.Popen([*args, *(["--stream"] if stream else [])], cwd=REPO,
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip
        self.lines: list[str] = []
        self.first_ack = threading.Event()
        self._reader = threading.Thread(target=self._read)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("ack "):
                self.first_ack.set()

    def keys(self, kind: str) -> list[str]:
        """Keys of the whole ``kind`` lines (a killed writer's last line may be cut short)."""
        out = []
        for line in self.lines:
            if line.endswith("\n") and line.startswith(f"{kind} "):
                out.append(line.split()[1])
        return out

    def finish(self) -> int:
        self.proc.wait(60)
        self._reader.join(30)
        return self.proc.returncode


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["arena", "stream"])
def test_sigkill_during_ssd_writes(start_daemon, stream):
    # Eviction is a cache's right: size the SSD tier so that nothing written here is evicted,
    # and any loss is a crash-safety bug.
    d = start_daemon(cpu="8MiB", ssd="4GiB")
    acknowledged: set[str] = set()
    attempted: list[str] = []
    rnd = random.Random(7)
    writer_signals: list[int] = []  # writers the client library killed (module docstring)
    for cycle in range(CYCLES):
        writer = Writer(d.socket_path, cycle, stream)
        assert writer.first_ack.wait(60), f"the writer acknowledged nothing: {writer.lines}"
        threading.Event().wait(rnd.uniform(0.3, 1.2))
        d.kill()  # SIGKILL, mid-write
        if (rc := writer.finish()) < 0:  # the client library's crash, not the daemon's
            writer_signals.append(-rc)
        attempted += writer.keys("try")
        acknowledged.update(writer.keys("ack"))
        d.start()
        with KVClient(d.socket_path, timeout_s=30) as c:
            found = c.lookup(attempted).found
            for key, present in zip(attempted, found, strict=True):
                if key in acknowledged:
                    assert present, f"acknowledged object {key} lost after SIGKILL {cycle}"
                if present:  # acknowledged or not, what is served must be whole and right
                    assert bytes(c.get(key)) == payload(key, size_of(key)), key
    assert len(acknowledged) > CYCLES  # the test did write while being killed
    print(f"{'stream' if stream else 'arena'}: {CYCLES} SIGKILLs, {len(attempted)} puts "
          f"attempted, {len(acknowledged)} acknowledged, all intact; writers killed by "
          f"signals {writer_signals or 'none'}")  # fmt: skip
