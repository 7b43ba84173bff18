"""A daemon with a remote tier on a throw-away Redis Cluster, and helpers to put contexts there."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from redis.crc import key_slot

from benchmarks._support.daemon_proc import DaemonProcess, write_config
from benchmarks._support.redis_cluster import RedisClusterProcs
from benchmarks._support.workload import payload
from kvtierd.client import KVClient
from kvtierd.storage.remote_format import object_keys

KiB = 1 << 10


def remote_tier(cluster: RedisClusterProcs, namespace: str) -> dict[str, object]:
    """Short timeouts so a dead node costs a test a second, not the defaults' ten."""
    return {
        "name": "remote",
        "kind": "remote",
        "capacity": 0,
        "options": {
            "nodes": cluster.addresses,
            "namespace": namespace,
            "value_bytes": "64KiB",
            "connect_timeout_s": 0.3,
            "socket_timeout_s": 1.0,
            "op_timeout_s": 3.0,
            # a lookup asks about keys another daemon stored for this long: these tests are
            # about faults, not speed (test_redis_hung.py checks the default budget)
            "lookup_budget_s": 2.0,
            "health_interval_s": 0.2,
        },
    }


def start_remote_daemon(
    directory: Path,
    cluster: RedisClusterProcs,
    namespace: str = "",
    *,
    started: list[DaemonProcess],
    **settings: object,
) -> DaemonProcess:
    """Start a daemon; it goes into ``started`` first, so the caller's teardown kills it even
    when its start fails half way."""
    namespace = namespace or f"f-{uuid.uuid4().hex[:10]}"
    config = write_config(
        directory,
        cpu=settings.pop("cpu", "8MiB"),
        ssd=settings.pop("ssd", "16MiB"),
        extra_tiers=[remote_tier(cluster, namespace)],
        **settings,
    )
    d = DaemonProcess(config, str(directory / "kvtierd.sock"), directory / "daemon.log")
    started.append(d)
    return d.start()


def namespace_of(d: DaemonProcess) -> str:
    import yaml

    doc = yaml.safe_load(d.config.read_text())
    return str(doc["tiers"][-1]["options"]["namespace"])


def size_of(key: str) -> int:
    return 16 * KiB + hash_bytes(key) % (150 * KiB)  # 1 to 3 parts of 64 KiB


def hash_bytes(key: str) -> int:
    import zlib

    return zlib.crc32(key.encode())


def put_on_remote(c: KVClient, keys: list[str]) -> None:
    """Store each key as its own context, then drain cpu and ssd so all sit on the remote."""
    for key in keys:
        c.put(key, payload(key, size_of(key)), context_id=key)
    settle(c)
    c.drain("cpu")
    c.drain("ssd")
    settle(c)
    where = {ctx.context_id: ctx.tier for ctx in c.contexts()}
    assert all(where.get(k) == "remote" for k in keys), where


def settle(c: KVClient, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while c.status().pending_plans and time.monotonic() < deadline:
        time.sleep(0.02)


def port_of(cluster: RedisClusterProcs, namespace: str, key: str, tenant: str = "") -> int:
    """The Redis node holding the object (all its keys share one hash tag, one slot)."""
    header = object_keys(namespace, tenant, key).header
    return cluster.port_of_slot(key_slot(header.encode()))


def wait_health(c: KVClient, serving: bool, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        health = c.status().health
        if (health == "SERVING") == serving or time.monotonic() > deadline:
            return health
        time.sleep(0.1)
