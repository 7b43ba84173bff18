"""The remote tier against a real 3-master Redis Cluster on loopback (tests/storage/conftest.py).

Exact assertions on bytes and on the keys left in Redis; faults are injected by killing a real
``redis-server`` and by tampering with the stored keys through a raw client.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import threading
import time

import pytest
import redis.cluster
import xxhash

from kvtierd.config import TierConfig
from kvtierd.errors import (
    AlreadyExistsError,
    ConfigError,
    CorruptObjectError,
    NotFoundError,
    StorageFullError,
    UnavailableError,
)
from kvtierd.storage.base import TIERS
from kvtierd.storage.remote import RemoteTier
from kvtierd.storage.remote_format import object_keys
from kvtierd.types import ObjectMeta

try:  # see conftest.py
    from benchmarks._support import redis_cluster as redis_cluster_module
except ModuleNotFoundError:
    import redis_cluster as redis_cluster_module  # type: ignore[no-redef]

RedisClusterProcs = redis_cluster_module.RedisClusterProcs

pytestmark = pytest.mark.redis

MiB = 1 << 20


def _payload(size: int, seed: int = 0) -> bytes:
    return os.urandom(size) if seed == 0 else bytes((i * seed) % 251 for i in range(size))


def _keys_of(raw: redis.cluster.RedisCluster, namespace: str) -> list[str]:
    return sorted(k.decode() for k in raw.scan_iter(match=f"{namespace}:*", count=1000))


async def _put(tier: RemoteTier, key: str, data: bytes, tenant: str = "") -> ObjectMeta:
    meta = ObjectMeta(key=key, size_bytes=len(data), tenant=tenant, shape=(2, len(data) // 2))
    return await tier.put(meta, memoryview(data))


async def _get(tier: RemoteTier, key: str, size: int, tenant: str = "") -> bytes:
    buf = bytearray(size)
    await tier.read_into(key, memoryview(buf), tenant=tenant)
    return bytes(buf)


def test_registered_as_remote_kind() -> None:
    assert TIERS.get("remote") is RemoteTier


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"nodes": ["127.0.0.1:1"], "bogus": 1}, "unknown option"),
        ({"nodes": "127.0.0.1:1"}, "'nodes' must be a list"),
        ({"nodes": ["127.0.0.1"]}, "is not 'host:port'"),
        ({"nodes": ["127.0.0.1:1"], "namespace": "a{b}"}, "namespace"),
        ({"nodes": ["127.0.0.1:1"], "value_bytes": "1GiB"}, "value_bytes"),
    ],
)
def test_bad_options_are_config_errors(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RemoteTier(TierConfig("remote", "remote", 0, "", options))


async def test_start_without_cluster_is_unavailable_quickly() -> None:
    tier = RemoteTier(TierConfig("r", "remote", 0, "", {"nodes": ["127.0.0.1:1"]}))
    started = time.monotonic()
    with pytest.raises(UnavailableError, match="unreachable"):
        await tier.start()
    assert time.monotonic() - started < 10


async def test_round_trip_small_and_multipart(remote_tier, raw_redis) -> None:
    tier = await remote_tier(value_bytes="1MiB")
    small, big = _payload(1000), _payload(10 * MiB)
    meta = ObjectMeta(
        key="ctx/0", size_bytes=len(small), context_id="ctx", variant="knorm@0.5", dtype="bf16",
        shape=(2, 500), layout="KV_2LTD", token_count=7, kept_indices=b"\x01\0\0\0", tenant="",
    )  # fmt: skip
    stored = await tier.put(meta, memoryview(small))
    assert stored.checksum == xxhash.xxh3_64_intdigest(small)
    assert await _get(tier, "ctx/0", len(small)) == small
    assert tier.get_meta("ctx/0") == stored
    assert await tier.fetch_meta("ctx/0") == stored
    await _put(tier, "ctx/1", big)
    assert await _get(tier, "ctx/1", len(big)) == big
    assert tier.contains("ctx/1") and not tier.contains("ctx/2")
    # 1 header + 1 part for the small object, 1 header + 10 parts for the 10 MiB one
    assert len(_keys_of(raw_redis, tier.options.namespace)) == 2 + 11
    await _put(tier, "empty", b"")
    assert await _get(tier, "empty", 0) == b""
    assert tier.used_bytes() == len(small) + len(big) and tier.object_count() == 3
    assert sorted(m.key for m in tier.metas()) == ["ctx/0", "ctx/1", "empty"]


async def test_put_twice_and_delete(remote_tier, raw_redis) -> None:
    tier = await remote_tier(value_bytes="1MiB")
    await _put(tier, "k", _payload(3 * MiB))
    with pytest.raises(AlreadyExistsError):
        await _put(tier, "k", _payload(MiB))
    await tier.delete("k")
    assert _keys_of(raw_redis, tier.options.namespace) == []
    with pytest.raises(NotFoundError):
        await tier.delete("k")
    with pytest.raises(NotFoundError):
        await _get(tier, "k", 3 * MiB)
    assert tier.used_bytes() == 0


async def test_keys_are_hashed_and_one_slot_per_object(remote_tier, raw_redis) -> None:
    tier = await remote_tier(value_bytes=1000)
    nasty = ["{evil}", "*", "a b\nc", "ключ", "../../etc/passwd", ":m"]
    for i, key in enumerate(nasty):
        await _put(tier, key, _payload(2500, seed=i + 1), tenant="t{1}")
    for i, key in enumerate(nasty):
        assert await _get(tier, key, 2500, tenant="t{1}") == _payload(2500, seed=i + 1)
    names = _keys_of(raw_redis, tier.options.namespace)
    ns = re.escape(tier.options.namespace)
    pattern = re.compile(rf"^{ns}:\{{[0-9a-f]{{32}}\}}:(m|[0-9a-f]{{16}}:[0-9]+)$")
    assert len(names) == len(nasty) * 4 and all(pattern.match(n) for n in names), names
    for key in nasty:  # header and parts in one slot: one node, one pipeline, one script
        tag = object_keys(tier.options.namespace, "t{1}", key).tag
        slots = {raw_redis.keyslot(n) for n in names if f"{{{tag}}}" in n}
        assert len(slots) == 1


async def test_partial_write_is_invisible(remote_tier, raw_redis) -> None:
    tier = await remote_tier(value_bytes="1MiB")
    keys = object_keys(tier.options.namespace, "", "crashed")
    for i in range(3):  # a writer that died after its parts, before its header
        raw_redis.set(keys.part("00112233aabbccdd", i), b"x" * MiB, px=60_000)
    assert not tier.contains("crashed")
    with pytest.raises(NotFoundError):
        await _get(tier, "crashed", 3 * MiB)
    assert [m.key for m in tier.metas()] == []
    # a real put whose staging is cut short: the commit refuses, nothing stays behind
    original = tier._writer._stage_parts

    def stage_then_lose_one(part_keys: list[str], view: memoryview) -> None:
        original(part_keys, view)
        assert raw_redis.pttl(part_keys[0]) > 0  # staged parts expire if never committed
        raw_redis.delete(part_keys[1])

    tier._writer._stage_parts = stage_then_lose_one  # type: ignore[method-assign]
    with pytest.raises(UnavailableError, match="expired before commit"):
        await _put(tier, "cut", _payload(3 * MiB))
    tier._writer._stage_parts = original  # type: ignore[method-assign]
    assert not tier.contains("cut")
    tag = object_keys(tier.options.namespace, "", "cut").tag
    assert [n for n in _keys_of(raw_redis, tier.options.namespace) if tag in n] == []


@pytest.mark.parametrize("damage", ["delete", "truncate"])
async def test_missing_or_short_part_is_a_miss_and_cleaned(remote_tier, raw_redis, damage) -> None:
    tier = await remote_tier(value_bytes="1MiB")
    await _put(tier, "k", _payload(3 * MiB))
    part = next(n for n in _keys_of(raw_redis, tier.options.namespace) if n.endswith(":2"))
    if damage == "delete":
        raw_redis.delete(part)
    else:
        raw_redis.set(part, b"short")
    with pytest.raises(NotFoundError, match="incomplete"):
        await _get(tier, "k", 3 * MiB)
    assert _keys_of(raw_redis, tier.options.namespace) == []


def test_missing_redis_server_fails_with_a_clear_message(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(redis_cluster_module.shutil, "which", lambda name: None)
    monkeypatch.setattr(redis_cluster_module, "REDIS_SERVER", str(tmp_path / "no-redis-server"))
    with pytest.raises(
        redis_cluster_module.RedisClusterError, match="redis-server is not installed"
    ):
        RedisClusterProcs(tmp_path)


def test_a_node_whose_port_is_taken_starts_on_another(monkeypatch, tmp_path) -> None:
    """The test cluster cannot bind port 0 (redis-server reads it as "no TCP"): a candidate
    port someone else listens on makes redis-server exit, and the helper tries another one."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))  # bound (not listening: a PING is refused at once)
        taken = held.getsockname()[1]
        candidates = iter([taken])
        real = redis_cluster_module._candidate_port
        offer = lambda used: next(candidates, None) or real(used)  # noqa: E731
        monkeypatch.setattr(redis_cluster_module, "_candidate_port", offer)
        procs = RedisClusterProcs(tmp_path, masters=1)
        node = procs.nodes[0]
        node.directory.mkdir(parents=True)
        try:
            procs._start_node(node)
            assert node.port != taken
            with procs.client(node.port) as c:
                assert c.ping()
        finally:
            procs.stop()


async def test_checksum_mismatch_detected_and_deleted(remote_tier, raw_redis) -> None:
    tier = await remote_tier(value_bytes="1MiB")
    data = _payload(3 * MiB)
    await _put(tier, "k", data)
    part = next(n for n in _keys_of(raw_redis, tier.options.namespace) if n.endswith(":1"))
    raw_redis.setrange(part, 12345, b"\xff" if data[MiB + 12345] != 0xFF else b"\0")
    with pytest.raises(CorruptObjectError, match="checksum mismatch"):
        await _get(tier, "k", 3 * MiB)
    assert _keys_of(raw_redis, tier.options.namespace) == []
    assert not tier.contains("k") and tier.used_bytes() == 0


async def test_unreadable_header_is_corrupt(remote_tier, raw_redis) -> None:
    tier = await remote_tier()
    await _put(tier, "k", _payload(100))
    raw_redis.set(object_keys(tier.options.namespace, "", "k").header, b"{not json")
    assert not tier.contains("k")
    with pytest.raises(CorruptObjectError, match="unreadable header"):
        await _get(tier, "k", 100)
    assert raw_redis.get(object_keys(tier.options.namespace, "", "k").header) is None


async def test_relabel_rewrites_the_header_for_every_daemon(remote_tier, raw_redis) -> None:
    """Issue 29: a split gives an object a new context; the shared header says so (parts,
    checksum and TTL unchanged), so another daemon and a restart read the new identity."""
    a = await remote_tier(value_bytes="1MiB", ttl_s=60.0)
    b = await remote_tier(value_bytes="1MiB", namespace=a.options.namespace)
    data = _payload(3 * MiB, seed=3)
    stored = await _put(a, "k", data, tenant="acme")
    header = object_keys(a.options.namespace, "acme", "k").header
    before = set(_keys_of(raw_redis, a.options.namespace))
    await a.relabel(stored.replace(context_id="k", parent_context_id="prompt"))
    moved = stored.replace(context_id="k", parent_context_id="prompt")
    assert b.get_meta("k", tenant="acme") == moved
    assert [m for m in b.metas() if m.key == "k"] == [moved]
    assert await _get(b, "k", len(data), tenant="acme") == data
    assert set(_keys_of(raw_redis, a.options.namespace)) == before
    assert 0 < raw_redis.pttl(header) <= 60_000
    with pytest.raises(NotFoundError, match="no object 'gone'"):
        await a.relabel(ObjectMeta(key="gone", size_bytes=1, tenant="acme"))


async def test_ttl_expiry(remote_tier, raw_redis) -> None:
    tier = await remote_tier(value_bytes="1MiB", ttl_s=1.0)
    await _put(tier, "k", _payload(2 * MiB))
    ttls = [raw_redis.pttl(n) for n in _keys_of(raw_redis, tier.options.namespace)]
    assert len(ttls) == 3 and all(0 < t <= 1000 for t in ttls), ttls
    assert tier.contains("k")
    await asyncio.sleep(1.3)
    assert not tier.contains("k")
    with pytest.raises(NotFoundError):
        await _get(tier, "k", 2 * MiB)
    assert _keys_of(raw_redis, tier.options.namespace) == []


async def test_two_daemons_share_objects(remote_tier) -> None:
    a = await remote_tier(value_bytes="1MiB")
    b = await remote_tier(value_bytes="1MiB", namespace=a.options.namespace)
    data = _payload(5 * MiB)
    stored = await _put(a, "ctx", data, tenant="acme")
    assert b.get_meta("ctx", tenant="acme") == stored  # asks Redis, not a local cache
    assert await _get(b, "ctx", len(data), tenant="acme") == data
    with pytest.raises(AlreadyExistsError):
        await _put(b, "ctx", data, tenant="acme")
    await b.delete("ctx", tenant="acme")
    assert not a.contains("ctx", tenant="acme")
    with pytest.raises(NotFoundError):
        await _get(a, "ctx", len(data), tenant="acme")


async def test_racing_puts_of_one_key_never_mix_parts(remote_tier, raw_redis) -> None:
    a = await remote_tier(value_bytes="1MiB")
    b = await remote_tier(value_bytes="1MiB", namespace=a.options.namespace)
    blobs = [_payload(4 * MiB, seed=3), _payload(4 * MiB, seed=5)]
    results = await asyncio.gather(
        _put(a, "k", blobs[0]), _put(b, "k", blobs[1]), return_exceptions=True
    )
    won = [i for i, r in enumerate(results) if isinstance(r, ObjectMeta)]
    assert len(won) == 1 and isinstance(results[1 - won[0]], AlreadyExistsError), results
    assert await _get(a, "k", 4 * MiB) == blobs[won[0]]
    assert len(_keys_of(raw_redis, a.options.namespace)) == 1 + 4  # the loser's parts are gone


async def test_namespace_and_tenant_isolation(remote_tier) -> None:
    one, two = await remote_tier(), await remote_tier()
    await _put(one, "k", b"one" * 10)
    assert not two.contains("k")
    await _put(two, "k", b"two" * 10)
    await _put(one, "k", b"other tenant", tenant="b")
    assert await _get(one, "k", 30) == b"one" * 10
    assert await _get(two, "k", 30) == b"two" * 10
    assert await _get(one, "k", 12, tenant="b") == b"other tenant"
    assert not one.contains("k", tenant="c")
    assert sorted((m.tenant, m.key) for m in one.metas()) == [("", "k"), ("b", "k")]


async def test_capacity_and_unbounded_stats(remote_tier) -> None:
    unbounded = await remote_tier()
    assert unbounded.unbounded and "capacity=unbounded" in unbounded.stats().detail
    bounded = await remote_tier(capacity_bytes=3 * MiB)
    await _put(bounded, "a", _payload(2 * MiB))
    with pytest.raises(StorageFullError):
        await _put(bounded, "b", _payload(2 * MiB))
    stats = bounded.stats()
    assert (stats.capacity_bytes, stats.used_bytes, stats.object_count) == (3 * MiB, 2 * MiB, 1)
    assert stats.healthy


async def test_bandwidth_meters_calibrated_and_updated(remote_tier) -> None:
    tier = await remote_tier()
    assert tier.read_meter.samples == 1 and tier.write_meter.samples == 1  # calibration
    assert tier.stats().read_bandwidth_bytes_per_s > 0
    data = _payload(8 * MiB)
    await _put(tier, "k", data)
    await _get(tier, "k", len(data))
    assert tier.read_meter.samples == 2 and tier.write_meter.samples == 2


def _on_port(tier: RemoteTier, cluster: RedisClusterProcs, port: int, prefix: str) -> str:
    """A key whose object lives on the master at ``port``."""
    for i in range(10_000):
        key = f"{prefix}-{i}"
        header = object_keys(tier.options.namespace, "", key).header
        if cluster.port_of_slot(redis.cluster.key_slot(header.encode())) == port:
            return key
    raise AssertionError(f"no key maps to port {port}")


async def test_node_killed_reads_miss_writes_refuse_then_recover(
    remote_tier, fresh_redis_cluster: RedisClusterProcs
) -> None:
    cluster = fresh_redis_cluster
    tier = await remote_tier(cluster, value_bytes="1MiB", health_interval_s=0.2, op_timeout_s=4.0)
    dead_port, live_port = cluster.nodes[0].port, cluster.nodes[1].port
    lost, kept = (
        _on_port(tier, cluster, dead_port, "lost"),
        _on_port(tier, cluster, live_port, "kept"),
    )
    data = _payload(2 * MiB)
    await _put(tier, lost, data)
    await _put(tier, kept, data)
    cluster.kill(0)

    started = time.monotonic()
    with pytest.raises(NotFoundError, match="unreachable"):
        await _get(tier, lost, len(data))
    with pytest.raises(UnavailableError):
        await _put(tier, _on_port(tier, cluster, dead_port, "new"), data)
    assert not tier.contains(lost)
    assert time.monotonic() - started < 3 * 4.0  # bounded, never hangs
    assert not tier.stats().healthy
    assert await _get(tier, kept, len(data)) == data  # the surviving masters still serve

    cluster.restart(0)  # --save '' and a SIGKILL: the node comes back empty, same slots
    deadline = time.monotonic() + 30
    for attempt in range(1000):  # until the clients reconnect and the node serves its slots
        fresh = _on_port(tier, cluster, dead_port, f"after{attempt}")
        try:
            await _put(tier, fresh, data)
            break
        except UnavailableError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
    assert await _get(tier, fresh, len(data)) == data
    with pytest.raises(NotFoundError):  # lost with the node's memory: a miss, not wrong bytes
        await _get(tier, lost, len(data))
    while not tier.stats().healthy and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert tier.stats().healthy, tier.stats().detail


async def test_put_worker_cancelled_after_timeout_does_not_commit(remote_tier) -> None:
    tier = await remote_tier(value_bytes="1MiB")
    cancelled = threading.Event()
    cancelled.set()
    meta = ObjectMeta(key="late", size_bytes=MiB)
    with pytest.raises(UnavailableError, match="timed out"):
        tier._writer.write(meta, memoryview(_payload(MiB)), cancelled)
    assert not tier.contains("late")
