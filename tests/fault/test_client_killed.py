"""Clients SIGKILLed mid-put: after Allocate (half the bytes copied into the arena, no Commit)
and in the middle of a PutStream. No partial object may ever be visible, the allocations must
be reclaimed (the arena ones within ``allocation_timeout_s``), and the same keys must be
storable again afterwards with their full bytes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from benchmarks._support.workload import payload
from kvtierd.client import KVClient
from kvtierd.rpc import kvtier_pb2 as pb
from kvtierd.rpc.framing import data_frame

pytestmark = pytest.mark.slow
MiB = 1 << 20
SIZE = 24 * MiB  # several 4 MiB stream parts; a visible share of the 128 MiB staging area
KILLS_EACH = 3
ALLOCATION_TIMEOUT_S = 1.0


def _arena_victim(socket_path: str, key: str, ready: mp.Queue) -> None:
    with KVClient(socket_path, timeout_s=30) as c:
        s = pb.ObjectSpec(key=key, context_id=key, size_bytes=SIZE, dtype="uint8")
        (alloc,) = c.call(c.kv.Allocate, pb.AllocateRequest(objects=[s])).allocations
        region = c._arena.region(alloc.region)
        region[: SIZE // 2] = payload(key, SIZE)[: SIZE // 2]
        ready.put(key)
        time.sleep(120)  # killed here: allocated, half written, never committed


def _stream_victim(socket_path: str, key: str, ready: mp.Queue) -> None:
    data = memoryview(payload(key, SIZE))

    def parts():
        yield pb.PutPart(spec=pb.ObjectSpec(key=key, context_id=key, size_bytes=SIZE))
        for start in range(0, SIZE // 2, 4 * MiB):
            yield data_frame(data[start : start + 4 * MiB])
        ready.put(key)
        time.sleep(120)  # killed here: half the stream sent

    with KVClient(socket_path, timeout_s=120, stream=True) as c:
        c._put_stream_call(parts(), timeout=120)


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_clients_killed_mid_put_leave_nothing(start_daemon):
    d = start_daemon(allocation_timeout_s=ALLOCATION_TIMEOUT_S)
    ctx = mp.get_context("spawn")
    ready: mp.Queue = ctx.Queue()
    victims = [(f"arena-{i}", _arena_victim) for i in range(KILLS_EACH)]
    victims += [(f"stream-{i}", _stream_victim) for i in range(KILLS_EACH)]
    procs = [ctx.Process(target=fn, args=(d.socket_path, key, ready)) for key, fn in victims]
    for p in procs:
        p.start()
    try:
        started = {ready.get(timeout=60) for _ in procs}
        assert started == {key for key, _ in victims}
        with KVClient(d.socket_path, timeout_s=30) as c:
            assert c.status().allocations == len(victims)  # every put is in flight
            for p in procs:
                os.kill(p.pid, signal.SIGKILL)
            for p in procs:
                p.join(10)
            keys = [key for key, _ in victims]
            assert c.lookup(keys).found == (False,) * len(keys)  # nothing partial, ever
            # Streams abort when the connection drops; arena allocations when they expire.
            reclaimed = _wait(lambda: c.status().allocations == 0, ALLOCATION_TIMEOUT_S + 5)
            assert reclaimed, f"{c.status().allocations} allocations of dead clients remain"
            assert c.lookup(keys).found == (False,) * len(keys)
            for key in keys:  # the same keys go in again, whole
                c.put(key, payload(key, SIZE), context_id=key)
                assert bytes(c.get(key)) == payload(key, SIZE), key
            assert c.status().health == "SERVING"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
