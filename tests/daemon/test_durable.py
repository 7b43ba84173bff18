"""What ``durable`` promises (docs/daemon.md): acknowledged once on a persistent tier, never
dropped by the placer before it has been read - across a restart too - and charged to a
tenant's quota once. The placer here is LRU with a small SSD tier, so it wants to drop."""

from __future__ import annotations

import asyncio
import time

import pytest

from benchmarks._support.daemon_proc import tcp_listener
from benchmarks._support.workload import payload
from kvtierd import errors
from kvtierd.client import AsyncKVClient, KVClient

MiB = 1 << 20
DURABLE = [f"durable-{i}" for i in range(4)]


def _settle(c: KVClient) -> None:
    deadline = time.monotonic() + 20
    while c.status().pending_plans and time.monotonic() < deadline:
        time.sleep(0.02)


def _pressure(c: KVClient, n: int, prefix: str = "cache") -> None:
    """Non-durable 1 MiB contexts, enough to push everything older out of both tiers."""
    for i in range(n):
        key = f"{prefix}-{i}"
        c.put(key, payload(key, MiB), context_id=key)
    _settle(c)


def _durable_state(c: KVClient) -> dict[str, tuple[int, bool]]:
    return {x.context_id: (x.durable_unread, x.durable_held) for x in c.contexts()}


def test_the_placer_never_drops_an_unread_durable_object(start_daemon):
    d = start_daemon(cpu="2MiB", ssd="4MiB")  # LRU: 6 MiB in all, then it drops
    with KVClient(d.socket_path, timeout_s=30) as c:
        for key in DURABLE:
            c.put(key, payload(key, MiB), context_id=key, durable=True)
        _pressure(c, 8)
        # Lookup is not a read: every durable object is still there, unread, held.
        assert c.lookup(DURABLE).found == (True,) * 4
        state = _durable_state(c)
        assert all(state[k] == (1, True) for k in DURABLE), state
        assert c.status().durable_holds == 4
        assert all(t == "ssd" for t in c.lookup(DURABLE).tiers)  # kept on the persistent copy
        assert c.lookup(["cache-0"]).found == (False,)  # the placer still drops the others
        for key in DURABLE:  # read once ...
            assert bytes(c.get(key)) == payload(key, MiB)
        _settle(c)  # back in the placer's view, which may drop them at once (ssd is full)
        assert all(_durable_state(c).get(k, (0, False)) == (0, False) for k in DURABLE)
        _pressure(c, 8, "later")  # ... then cached data like any other
        assert c.lookup(DURABLE).found == (False,) * 4
        assert c.status().durable_holds == 4  # no refusal after the read


def test_protection_survives_a_restart(start_daemon):
    d = start_daemon(cpu="2MiB", ssd="4MiB")
    with KVClient(d.socket_path, timeout_s=30) as c:
        for key in DURABLE[:2]:
            c.put(key, payload(key, MiB), context_id=key, durable=True)
        c.put("was-read", payload("was-read", MiB), context_id="was-read", durable=True)
        assert bytes(c.get("was-read")) == payload("was-read", MiB)
    d.kill()  # SIGKILL
    d.start()
    with KVClient(d.socket_path, timeout_s=30) as c:
        _pressure(c, 8)
        assert c.lookup(DURABLE[:2]).found == (True, True)
        # The daemon keeps no record of reads on disk: read before the crash, protected again.
        assert c.lookup(["was-read"]).found == (True,)
        for key in [*DURABLE[:2], "was-read"]:
            assert bytes(c.get(key)) == payload(key, MiB)


def test_unread_durable_objects_fill_at_most_the_persistent_tier(start_daemon):
    d = start_daemon(cpu="2MiB", ssd="4MiB")
    with KVClient(d.socket_path, timeout_s=30) as c:
        for key in DURABLE:
            c.put(key, payload(key, MiB), context_id=key, durable=True)
        with pytest.raises(errors.CapacityError, match=r"not read yet.*capacity of 4194304"):
            c.put("one-more", payload("one-more", MiB), context_id="one-more", durable=True)
        assert c.lookup(["one-more"]).found == (False,)  # refused: not stored
        c.get(DURABLE[0])  # read: its room counts for new durable objects again
        c.put("one-more", payload("one-more", MiB), context_id="one-more", durable=True)
        c.put("volatile", payload("volatile", MiB))  # non-durable puts are not refused


def test_explicit_evict_removes_an_unread_durable_object(start_daemon):
    d = start_daemon(cpu="2MiB", ssd="4MiB")
    with KVClient(d.socket_path, timeout_s=30) as c:
        c.put("k", payload("k", MiB), context_id="doc", durable=True)
        assert c.call(c.admin.Evict, _evict("doc")).evicted == 1
        assert c.lookup(["k"]).found == (False,)


def _evict(context_id: str) -> object:
    from kvtierd.rpc import kvtier_pb2 as pb

    return pb.EvictRequest(context_ids=[context_id])


def test_durable_objects_count_once_against_a_tenant_quota(start_daemon):
    """Issue 16 (2): quota {cpu: 2 MiB, ssd: 2 MiB} takes four 1 MiB objects, durable or not;
    a durable object's persistent copy under its CPU copy is not charged a second time."""
    tenants = [{"name": "a", "quota": {"cpu": "2MiB", "ssd": "2MiB"}}]
    d = start_daemon(cpu="64MiB", ssd="256MiB", tenants=tenants)
    with KVClient(d.socket_path, tenant="a", timeout_s=30) as a:
        keys = [f"k{i}" for i in range(4)]
        for key in keys:
            a.put(key, payload(key, MiB), context_id=key, durable=True)
            _settle(a)
        with pytest.raises(errors.CapacityError, match="4194304 bytes stored or being put"):
            a.put("k4", payload("k4", MiB), context_id="k4", durable=True)
        assert a.lookup(keys).found == (True,) * 4
        for key in keys:
            assert bytes(a.get(key)) == payload(key, MiB)


def test_durable_on_the_stream_path_survives_sigkill(start_daemon, tmp_path):
    """Issue 16 (1): PutStream committed without ``durable`` and the client dropped the flag,
    so a streamed durable put (the path of every TCP client) was lost to a SIGKILL."""
    tcp = tcp_listener(tmp_path)
    d = start_daemon(**tcp.settings)
    streamed = [f"stream-{i}" for i in range(4)]
    with KVClient(d.socket_path, stream=True) as c:
        for k in streamed:
            c.put(k, payload(k, MiB), context_id=k, durable=True)

    async def over_tcp() -> None:
        ca = str(tcp.ca_file)
        async with AsyncKVClient(address=tcp.address(d), tls_ca_file=ca, token="t0ken") as ac:
            await ac.put("tcp-aio", payload("tcp-aio", MiB), durable=True)

    asyncio.run(over_tcp())
    d.kill()  # SIGKILL: only what reached a persistent tier survives
    d.start()
    with KVClient(d.socket_path) as c:
        keys = [*streamed, "tcp-aio"]
        assert c.lookup(keys).found == (True,) * len(keys)
        for k in keys:
            assert bytes(c.get(k)) == payload(k, MiB)


def test_put_stream_refuses_durable_after_the_first_message(start_daemon):
    from kvtierd.rpc import kvtier_pb2 as pb

    d = start_daemon()
    spec = pb.ObjectSpec(key="k", size_bytes=8)
    with KVClient(d.socket_path) as c:
        parts = [pb.PutPart(spec=spec), pb.PutPart(data=b"x" * 8, durable=True)]
        with pytest.raises(errors.InvalidArgumentError, match="first message only"):
            c.call(c.kv.PutStream, iter(parts))
