"""8 client processes x hundreds of mixed operations against one daemon with a small CPU tier
(so objects keep moving between tiers): zero lost or corrupted objects."""

from __future__ import annotations

import multiprocessing as mp
import random

import pytest

from benchmarks._support.workload import payload, size_of
from kvtierd import errors
from kvtierd.client import KVClient

PROCESSES = 8
OPS = 200


def _worker(socket_path: str, worker: int, result: mp.Queue) -> None:
    rnd = random.Random(worker)
    live: set[str] = set()
    deleted: set[str] = set()
    counts = {"put": 0, "get": 0, "lookup": 0, "delete": 0, "touch": 0, "corrupt": 0, "lost": 0}
    with KVClient(socket_path, timeout_s=30) as c:
        for i in range(OPS):
            op = rnd.choices(["put", "get", "lookup", "delete", "touch"], [4, 4, 1, 1, 1])[0]
            if op == "put" or not live:
                key = f"w{worker}-{i}"
                c.put(key, payload(key, size_of(key, high=256 << 10)), context_id=key)
                live.add(key)
                counts["put"] += 1
                continue
            key = rnd.choice(sorted(live))
            if op == "get":
                try:
                    data = bytes(c.get(key))
                except errors.NotFoundError:
                    counts["lost"] += 1
                    continue
                counts["corrupt"] += data != payload(key, size_of(key, high=256 << 10))
            elif op == "lookup":
                counts["lost"] += not all(c.lookup(sorted(live)).found)
            elif op == "delete":
                assert c.delete([key]) == 1
                live.discard(key)
                deleted.add(key)
            else:
                c.touch([key])
            counts[op] += 1
        counts["lost"] += sum(not f for f in c.lookup(sorted(live)).found) if live else 0
        counts["lost"] += sum(c.lookup(sorted(deleted)).found) if deleted else 0  # resurrected
    result.put(counts)


@pytest.mark.slow
def test_eight_clients_mixed_operations(start_daemon):
    d = start_daemon(cpu="4MiB", ssd="512MiB")
    ctx = mp.get_context("spawn")
    result: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(d.socket_path, w, result)) for w in range(PROCESSES)]
    for p in procs:
        p.start()
    totals: dict[str, int] = {}
    for _ in procs:
        for k, v in result.get(timeout=240).items():
            totals[k] = totals.get(k, 0) + v
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert totals["lost"] == 0 and totals["corrupt"] == 0, totals
    assert totals["get"] > PROCESSES * OPS // 4
    with KVClient(d.socket_path) as c:
        tiers = {t.name: t for t in c.tiers()}
        assert tiers["ssd"].object_count > 0, "the small CPU tier should have spilled to SSD"
        assert c.status().health == "SERVING"
