"""Bounded load test: N client processes x mixed operations against one real daemon.

Each worker keeps at most ``--live`` objects of its own (deleting the oldest), so the data set
stays far below the SSD tier's capacity: a miss on a live object is a LOSS, not an eviction.
Every byte read is compared with the deterministic payload of its key
(benchmarks/_support/workload.py).
With ``--restart-every S`` the driver kills the daemon every S seconds (SIGKILL and SIGTERM in
turn) and starts it again; workers then count clean errors (``kvtierd.errors``), reconnect, and
afterwards every durable put they had acknowledged must read back whole. A delete the daemon
died under may or may not have happened: its key must read back whole or be gone.

    python -m benchmarks.micro.bench_load --clients 16 --seconds 120 [--restart-every 20] [--json F]

Reports ops/s and GB/s (1e9 B/s), p50/p99 latency per operation, lost and corrupt objects,
bytes verified, and the faults injected and survived.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._support.common import print_machine

KiB, MiB = 1 << 10, 1 << 20
OPS = ("put", "put_durable", "put_stream", "put_stream_durable", "get", "get_stream", "lookup",
       "touch", "delete")  # fmt: skip
WEIGHTS = (3, 1, 1, 1, 4, 1, 1, 1, 1)
DURABLE_PUTS = ("put_durable", "put_stream_durable")  # the arena path and the stream (TCP) path


@dataclass
class WorkerResult:
    latencies_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    bytes_written: int = 0
    bytes_read: int = 0
    bytes_verified: int = 0
    corrupt: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    clean_errors: int = 0
    other_errors: list[str] = field(default_factory=list)
    durable_acknowledged: int = 0
    unsure_deletes: int = 0
    unsure_deletes_done: int = 0


def size_of(key: str, max_bytes: int) -> int:
    from benchmarks._support.workload import size_of as sized

    return sized(key, low=4 * KiB, high=max_bytes)


class Worker:
    """One client process's loop; ``restarts`` says daemon restarts may happen under it."""

    def __init__(self, socket_path: str, wid: int, max_bytes: int, live: int, restarts: bool):
        self.socket_path, self.wid, self.max_bytes = socket_path, wid, max_bytes
        self.live_max, self.restarts = live, restarts
        self.rnd = random.Random(wid)
        self.live: dict[str, bool] = {}  # key -> durable acknowledged
        self.deleted: set[str] = set()
        # Deletes the daemon died under: gone or intact are both right, never other bytes.
        self.unsure: set[str] = set()
        self.r = WorkerResult()
        self.n = 0

    def expected(self, key: str) -> bytes:
        from benchmarks._support.workload import payload

        return payload(key, size_of(key, self.max_bytes))

    def check(self, key: str, data: bytes) -> None:
        if data != self.expected(key):
            self.r.corrupt.append(key)
        else:
            self.r.bytes_verified += len(data)
        self.r.bytes_read += len(data)

    def _kind(self, key: str) -> str:
        return "durable" if self.live[key] else "volatile"

    def one(self, c, s, op: str) -> None:
        from kvtierd import errors

        if op.startswith("put") or not self.live:
            key = f"w{self.wid}-{self.n}"
            self.n += 1
            data = self.expected(key)
            client = s if op.startswith("put_stream") else c
            client.put(key, data, context_id=key, durable=op in DURABLE_PUTS)
            self.live[key] = op in DURABLE_PUTS
            self.r.bytes_written += len(data)
            if len(self.live) > self.live_max:
                oldest = next(iter(self.live))
                if self.delete(c, oldest) != 1 and not self.restarts:
                    self.r.lost.append(f"{oldest} (delete found nothing)")
            return
        key = self.rnd.choice(list(self.live))
        if op in ("get", "get_stream"):
            try:
                self.check(key, bytes((s if op == "get_stream" else c).get(key)))
            except errors.NotFoundError:
                if self.restarts and not self.live[key]:
                    del self.live[key]  # volatile and the daemon restarted: not a loss
                else:
                    self.r.lost.append(f"{key} ({op}: {self._kind(key)})")
                    del self.live[key]
        elif op == "lookup":
            found = c.lookup([key]).found[0]
            if not found and (self.live[key] or not self.restarts):
                self.r.lost.append(f"{key} (lookup: {self._kind(key)})")
        elif op == "touch":
            c.touch([key])
        else:
            self.delete(c, key)

    def delete(self, c, key: str) -> int:
        """Delete ``key``; if the daemon goes away meanwhile, the delete may or may not have
        happened, so the key is no longer expected either way."""
        from kvtierd import errors

        del self.live[key]
        try:
            n = c.delete([key])
        except errors.KvtierError:
            self.unsure.add(key)
            raise
        self.deleted.add(key)
        return int(n)

    def run(self, seconds: float, stop: Any = None) -> WorkerResult:
        """Load the daemon for ``seconds``, and on until ``stop`` (an Event) is set."""
        from kvtierd import errors
        from kvtierd.client import KVClient

        deadline = time.monotonic() + seconds
        c = s = None
        while time.monotonic() < deadline or (stop is not None and not stop.is_set()):
            try:
                if c is None:
                    c = KVClient(self.socket_path, timeout_s=30)
                    s = KVClient(self.socket_path, timeout_s=30, stream=True)
                op = self.rnd.choices(OPS, WEIGHTS)[0]
                t0 = time.perf_counter()
                self.one(c, s, op)
                self.r.latencies_s[op].append(time.perf_counter() - t0)
            except errors.KvtierError as e:
                if not self.restarts:
                    self.r.other_errors.append(f"{type(e).__name__}: {e}"[:300])
                self.r.clean_errors += 1
                for client in (c, s):
                    if client is not None:
                        client.close()
                c = s = None
                time.sleep(0.1)
            except Exception as e:  # not a kvtierd error: the client saw something unclean
                self.r.other_errors.append(f"{type(e).__name__}: {e}"[:300])
                c = s = None
                time.sleep(0.1)
        for client in (c, s):
            if client is not None:
                client.close()
        return self.r

    def final_check(self) -> None:
        """After the run (daemon up): every durable acknowledged object reads back whole, and
        every still-live object too when there were no restarts; deleted ones stay deleted."""
        from kvtierd import errors
        from kvtierd.client import KVClient

        with KVClient(self.socket_path, timeout_s=60) as c:
            must = [k for k, durable in self.live.items() if durable or not self.restarts]
            self.r.durable_acknowledged = sum(self.live.values())
            for key in must:
                try:
                    self.check(key, bytes(c.get(key)))
                except errors.NotFoundError:
                    self.r.lost.append(f"{key} (final get: {self._kind(key)})")
            for key in sorted(self.unsure):
                try:
                    self.check(key, bytes(c.get(key)))
                except errors.NotFoundError:
                    self.r.unsure_deletes_done += 1
            self.r.unsure_deletes = len(self.unsure)
            gone = sorted(self.deleted)
            if gone and not self.restarts:
                back = [k for k, f in zip(gone, c.lookup(gone).found, strict=True) if f]
                self.r.lost.extend(f"resurrected:{k}" for k in back)


@dataclass(frozen=True)
class LoadConfig:
    clients: int = 16
    seconds: float = 120.0
    max_bytes: int = 256 * KiB
    live: int = 48  # objects each client keeps
    restart_every_s: float = 0.0  # 0: never restart the daemon
    # At least this many restarts, however long they take (clients go on until they are done):
    # a restart takes seconds on a loaded machine, so a count by time is not deterministic
    min_restarts: int = 0


def _worker_main(socket_path: str, wid: int, cfg: LoadConfig, *, go, stop, done, check) -> None:
    w = Worker(socket_path, wid, cfg.max_bytes, cfg.live, cfg.restart_every_s > 0)
    try:
        go.wait(60)
        w.run(cfg.seconds, stop)
    finally:
        done.put(wid)  # the driver never waits on a worker that died
    try:
        check.get(timeout=300)  # the driver says when the daemon is up for the final check
        w.final_check()
    except Exception as e:
        w.r.other_errors.append(f"final check: {type(e).__name__}: {e}"[:300])
    w.r.latencies_s = dict(w.r.latencies_s)
    done.put(asdict(w.r))


@dataclass
class LoadResult:
    clients: int
    seconds: float
    ops: int
    ops_per_s: float
    write_gb_per_s: float
    read_gb_per_s: float
    latency_ms: dict[str, dict[str, float]]
    bytes_verified: int
    lost: list[str]
    corrupt: list[str]
    clean_errors: int
    other_errors: list[str]
    restarts_injected: int
    restarts_survived: int
    durable_acknowledged: int
    unsure_deletes: int
    unsure_deletes_done: int


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3


def run_load(daemon, cfg: LoadConfig) -> LoadResult:
    """Drive ``cfg.clients`` worker processes against ``daemon`` (a benchmarks._support.daemon_proc
    DaemonProcess); restart it every ``cfg.restart_every_s`` seconds when > 0."""
    clients, seconds, restart_every_s = cfg.clients, cfg.seconds, cfg.restart_every_s
    ctx = mp.get_context("spawn")
    go, stop, done = ctx.Event(), ctx.Event(), ctx.Queue()
    checks = [ctx.Queue() for _ in range(clients)]
    restarts = restart_every_s > 0
    procs = [
        ctx.Process(
            target=_worker_main,
            args=(daemon.socket_path, w, cfg),
            kwargs={"go": go, "stop": stop, "done": done, "check": checks[w]},
        )
        for w in range(clients)
    ]
    for p in procs:
        p.start()
    time.sleep(1.0)  # let the interpreters import before the clock starts
    go.set()
    from benchmarks._support.arenas import now_s, remove_dead_arenas

    since = now_s()
    t0 = time.monotonic()
    injected = survived = 0
    next_restart = t0 + restart_every_s

    def more() -> bool:
        return injected < cfg.min_restarts

    while restarts and (time.monotonic() < t0 + seconds - restart_every_s / 2 or more()):
        end = next_restart if more() else min(next_restart, t0 + seconds)
        time.sleep(max(0.0, end - time.monotonic()))
        if time.monotonic() >= t0 + seconds - 1 and not more():
            break
        if injected % 2 == 0:
            daemon.kill()
        else:
            daemon.stop()
        injected += 1
        remove_dead_arenas(since)  # arenas of killed daemons (file arenas of older daemons)
        daemon.start()
        survived += 1
        next_restart = time.monotonic() + restart_every_s
    stop.set()
    finished = {done.get(timeout=max(seconds, time.monotonic() - t0) + 120) for _ in procs}
    elapsed = time.monotonic() - t0
    assert finished == set(range(clients)), finished
    for q in checks:
        q.put("check")
    results = [done.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(30)
    lat: dict[str, list[float]] = defaultdict(list)
    for r in results:
        for op, values in r["latencies_s"].items():
            lat[op].extend(values)
    ops = sum(len(v) for v in lat.values())
    return LoadResult(
        clients=clients,
        seconds=round(elapsed, 1),
        ops=ops,
        ops_per_s=ops / elapsed,
        write_gb_per_s=sum(r["bytes_written"] for r in results) / elapsed / 1e9,
        read_gb_per_s=sum(r["bytes_read"] for r in results) / elapsed / 1e9,
        latency_ms={
            op: {"n": len(v), "p50": _pct(v, 0.5), "p99": _pct(v, 0.99)}
            for op, v in sorted(lat.items())
        },
        bytes_verified=sum(r["bytes_verified"] for r in results),
        lost=[k for r in results for k in r["lost"]],
        corrupt=[k for r in results for k in r["corrupt"]],
        clean_errors=sum(r["clean_errors"] for r in results),
        other_errors=[e for r in results for e in r["other_errors"]],
        restarts_injected=injected,
        restarts_survived=survived,
        durable_acknowledged=sum(r["durable_acknowledged"] for r in results),
        unsure_deletes=sum(r["unsure_deletes"] for r in results),
        unsure_deletes_done=sum(r["unsure_deletes_done"] for r in results),
    )


def report(r: LoadResult) -> str:
    lines = [
        f"{r.clients} clients, {r.seconds} s: {r.ops} ops, {r.ops_per_s:.0f} ops/s, "
        f"write {r.write_gb_per_s:.3f} GB/s, read {r.read_gb_per_s:.3f} GB/s",
        "| op | n | p50 ms | p99 ms |",
        "|---|---|---|---|",
        *(
            f"| {op} | {v['n']} | {v['p50']:.2f} | {v['p99']:.2f} |"
            for op, v in r.latency_ms.items()
        ),
        f"lost {len(r.lost)}, corrupt {len(r.corrupt)}, bytes verified {r.bytes_verified}, "
        f"clean errors {r.clean_errors}, other errors {len(r.other_errors)}, "
        f"restarts injected {r.restarts_injected} / survived {r.restarts_survived}, "
        f"durable acknowledged at the end {r.durable_acknowledged}, "
        f"deletes the daemon died under {r.unsure_deletes} ({r.unsure_deletes_done} done)",
    ]
    return "\n".join(lines)


def main() -> None:
    from benchmarks._support.daemon_proc import DaemonProcess, write_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--max-kib", type=int, default=256, help="largest object, KiB")
    ap.add_argument("--live", type=int, default=48, help="live objects per client")
    ap.add_argument("--restart-every", type=float, default=0.0, help="seconds; 0 = never")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    print_machine("bench_load")
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        config = write_config(directory, cpu="32MiB", ssd="2GiB")
        d = DaemonProcess(config, str(directory / "kvtierd.sock"), directory / "daemon.log")
        d.start()
        try:
            cfg = LoadConfig(a.clients, a.seconds, a.max_kib * KiB, a.live, a.restart_every)
            r = run_load(d, cfg)
        finally:
            d.kill()
    print(report(r))
    if a.json:
        a.json.write_text(json.dumps(asdict(r), indent=1))


if __name__ == "__main__":
    main()
