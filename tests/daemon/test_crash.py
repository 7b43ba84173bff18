"""SIGKILL the daemon while durable puts are being written to SSD, many times; after each
restart every acknowledged object must be intact and nothing partial may be served. Both put
paths: the shared-memory arena, and the stream every TCP client takes (where ``durable`` was
once dropped: issue 16.1)."""

from __future__ import annotations

import random
import threading

import pytest

from kvtierd import errors
from kvtierd.client import KVClient
from tests.daemon.workload import payload, size_of

CYCLES = 6
PUTS_PER_CYCLE = 400  # at most ~400 MiB a cycle: the 4 GiB SSD tier never has to evict


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["arena", "stream"])
def test_sigkill_during_ssd_writes(start_daemon, stream):
    # Eviction is a cache's right: size the SSD tier so that nothing written here is evicted,
    # and any loss is a crash-safety bug.
    d = start_daemon(cpu="8MiB", ssd="4GiB")
    acknowledged: list[str] = []
    attempted: list[str] = []
    rnd = random.Random(7)
    for cycle in range(CYCLES):
        stop = threading.Event()

        def writer(cycle: int = cycle, stop: threading.Event = stop) -> None:
            with KVClient(d.socket_path, timeout_s=10, stream=stream) as c:
                i = 0
                while not stop.is_set() and i < PUTS_PER_CYCLE:
                    key = f"c{cycle}-{i}"
                    i += 1
                    attempted.append(key)
                    try:
                        c.put(key, payload(key, size_of(key)), durable=True)
                    except errors.KvtierError:
                        return  # the daemon died under us: this put was not acknowledged
                    acknowledged.append(key)

        t = threading.Thread(target=writer)
        t.start()
        threading.Event().wait(rnd.uniform(0.3, 1.2))
        d.kill()  # SIGKILL, mid-write
        stop.set()
        t.join(30)
        assert not t.is_alive()
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
          f"attempted, {len(acknowledged)} acknowledged, all intact")  # fmt: skip
