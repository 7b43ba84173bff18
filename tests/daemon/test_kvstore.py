"""KVStore behaviour through a real daemon over its Unix socket: puts and gets through the
arena, streams, prefix lookups, leases, tier moves, and every bad input the issue names."""

from __future__ import annotations

import os
import stat
import time

import grpc
import numpy as np
import pytest
import torch

from kvtierd import errors
from kvtierd.client import AsyncKVClient, KVClient
from kvtierd.rpc import kvtier_pb2 as pb
from kvtierd.rpc import kvtier_pb2_grpc as pb_grpc

MiB = 1 << 20


@pytest.fixture
def daemon(start_daemon):
    return start_daemon(cpu="16MiB", ssd="64MiB")


@pytest.fixture
def client(daemon):
    with KVClient(daemon.socket_path, timeout_s=20) as c:
        yield c


def stub(daemon) -> pb_grpc.KVStoreStub:
    return pb_grpc.KVStoreStub(grpc.insecure_channel(f"unix:{daemon.socket_path}"))


def test_socket_is_private(daemon):
    mode = stat.S_IMODE(os.stat(daemon.socket_path).st_mode)
    assert mode == 0o600


def test_numpy_and_torch_round_trip(client):
    a = np.random.default_rng(0).standard_normal((2, 4, 16, 128)).astype(np.float16)
    t = torch.randn(2, 3, 5, dtype=torch.bfloat16)
    client.put("np", a, context_id="c", layout="KV_2LTD", token_count=16)
    client.put("pt", t, context_id="c")
    assert np.array_equal(client.get("np"), a)
    out = torch.empty_like(t)
    client.get("pt", out=out)
    assert torch.equal(out, t)
    with client.lease("np") as (info, view):
        assert info.spec.shape == [2, 4, 16, 128] and info.spec.dtype == "float16"
        assert info.spec.layout == "KV_2LTD" and info.spec.token_count == 16
        assert bytes(view) == a.tobytes()


def test_prefix_lookup(client):
    for i in range(3):
        client.put(f"chunk{i}", bytes([i]) * 4096, context_id="req")
    r = client.lookup(["chunk0", "chunk1", "missing", "chunk2"])
    assert r.found == (True, True, False, True)
    assert r.prefix_hits == 2


def test_demote_and_promote_across_cpu_and_ssd(client):
    # 16 MiB CPU tier: the third 6 MiB context pushes the least recently used one to SSD.
    data = {f"ctx{i}": np.full(6 * MiB, i, np.uint8) for i in range(3)}
    for key, value in data.items():
        client.put(key, value, context_id=key)
    tiers = dict(zip(data, _settled_tiers(client, list(data)), strict=True))
    assert tiers == {"ctx0": "ssd", "ctx1": "cpu", "ctx2": "cpu"}
    # Reading ctx0 serves it from SSD and promotes it; ctx1 (now LRU) goes down.
    assert np.array_equal(client.get("ctx0"), data["ctx0"])
    tiers = dict(zip(data, _settled_tiers(client, list(data)), strict=True))
    assert tiers == {"ctx0": "cpu", "ctx1": "ssd", "ctx2": "cpu"}
    for key, value in data.items():
        assert np.array_equal(client.get(key), value)


def _settled_tiers(client, keys, timeout_s=10.0):
    """Tier moves run in the background: wait until the executor has no plan pending."""
    deadline = time.monotonic() + timeout_s
    while client.status().pending_plans and time.monotonic() < deadline:
        time.sleep(0.01)
    return client.lookup(keys).tiers


def test_stream_put_and_get(daemon):
    s = stub(daemon)
    payload = os.urandom(9 * MiB + 5)
    spec = pb.ObjectSpec(key="s", size_bytes=len(payload))
    parts = [pb.PutPart(spec=spec)] + [
        pb.PutPart(data=payload[i : i + 4 * MiB]) for i in range(0, len(payload), 4 * MiB)
    ]
    resp = s.PutStream(iter(parts))
    assert resp.object.spec.size_bytes == len(payload)
    got = list(s.GetStream(pb.GetStreamRequest(key="s", part_bytes=1 * MiB)))
    assert got[0].info.spec.key == "s"
    assert b"".join(c.data for c in got[1:]) == payload


def test_short_or_long_stream_is_refused_and_leaves_nothing(daemon):
    s = stub(daemon)
    spec = pb.ObjectSpec(key="short", size_bytes=100)
    with pytest.raises(grpc.RpcError) as e:
        s.PutStream(iter([pb.PutPart(spec=spec), pb.PutPart(data=b"x" * 60)]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ended after 60 of 100 bytes" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        s.PutStream(iter([pb.PutPart(spec=spec), pb.PutPart(data=b"x" * 160)]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        s.PutStream(iter([pb.PutPart(data=b"x")]))
    assert "first message must carry the object spec" in e.value.details()
    assert not stub(daemon).Lookup(pb.LookupRequest(keys=["short"])).found[0]
    status = pb_grpc.AdminStub(grpc.insecure_channel(f"unix:{daemon.socket_path}")).Status(
        pb.StatusRequest()
    )
    assert status.allocations == 0 and status.objects == 0


def test_client_gone_mid_stream_leaves_no_partial_object(daemon):
    s = stub(daemon)
    spec = pb.ObjectSpec(key="gone", size_bytes=8 * MiB)

    def parts():
        yield pb.PutPart(spec=spec)
        yield pb.PutPart(data=b"x" * MiB)
        raise RuntimeError("client dies")

    with pytest.raises(grpc.RpcError):
        s.PutStream(parts())
    admin = pb_grpc.AdminStub(grpc.insecure_channel(f"unix:{daemon.socket_path}"))
    for _ in range(100):
        if admin.Status(pb.StatusRequest()).allocations == 0:
            break
    assert admin.Status(pb.StatusRequest()).allocations == 0
    assert not s.Lookup(pb.LookupRequest(keys=["gone"])).found[0]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (pb.ObjectSpec(key="", size_bytes=10), "object key is empty"),
        (pb.ObjectSpec(key="z", size_bytes=0), "size_bytes must be > 0"),
        (pb.ObjectSpec(key="big", size_bytes=1 << 40), "larger than any tier"),
        (pb.ObjectSpec(key="dt", size_bytes=8, dtype="float13"), "unknown dtype 'float13'"),
        (
            pb.ObjectSpec(key="lay", size_bytes=10, dtype="float16", shape=[2, 3]),
            "layout mismatch: shape [2, 3] of float16 is 12 bytes but size_bytes is 10",
        ),
        (pb.ObjectSpec(key="ki", size_bytes=8, kept_indices=b"abc"), "kept_indices"),
    ],
)
def test_bad_object_specs(daemon, spec, message):
    with pytest.raises(grpc.RpcError) as e:
        stub(daemon).Allocate(pb.AllocateRequest(objects=[spec]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.details()


def test_double_commit_unknown_allocation_and_existing_key(daemon, client):
    s = stub(daemon)
    (alloc,) = s.Allocate(
        pb.AllocateRequest(objects=[pb.ObjectSpec(key="k", size_bytes=8)])
    ).allocations
    s.Commit(pb.CommitRequest(allocation_ids=[alloc.allocation_id]))
    with pytest.raises(grpc.RpcError) as e:
        s.Commit(pb.CommitRequest(allocation_ids=[alloc.allocation_id]))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(grpc.RpcError) as e:
        s.Commit(pb.CommitRequest(allocation_ids=["nope"]))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(errors.AlreadyExistsError):
        client.put("k", b"12345678")


def test_commit_listing_an_allocation_twice_is_refused_and_keeps_it(daemon, client):
    s = stub(daemon)
    (alloc,) = s.Allocate(
        pb.AllocateRequest(objects=[pb.ObjectSpec(key="twice", size_bytes=8)])
    ).allocations
    for durable in (False, True):
        with pytest.raises(grpc.RpcError) as e:
            s.Commit(pb.CommitRequest(allocation_ids=[alloc.allocation_id] * 2, durable=durable))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "listed twice" in e.value.details()
    s.Commit(pb.CommitRequest(allocation_ids=[alloc.allocation_id]))  # still open: commits once
    assert client.lookup(["twice"]).found == (True,)


def test_unknown_key_and_lease_errors(daemon, client):
    with pytest.raises(errors.NotFoundError, match="'nope' not found"):
        client.get("nope")
    s = stub(daemon)
    client.put("x", b"abc")
    (lease,) = s.Get(pb.GetRequest(keys=["x"])).leases
    s.Release(pb.ReleaseRequest(lease_ids=[lease.lease_id]))
    with pytest.raises(grpc.RpcError) as e:
        s.Release(pb.ReleaseRequest(lease_ids=[lease.lease_id]))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert "already released" in e.value.details()


def test_lease_keeps_bytes_alive_across_delete(client):
    client.put("held", b"A" * 8192)
    with client.lease("held") as (_, view):
        assert client.delete(["held"]) == 1
        client.put("other", b"B" * 8192)  # may reuse freed space: must not be ours
        assert bytes(view) == b"A" * 8192
    assert not client.lookup(["held"]).found[0]


def test_arena_full_is_resource_exhausted(daemon):
    s = stub(daemon)
    # 16 MiB capacity + 128 MiB staging: uncommitted allocations fill the arena.
    specs = [pb.ObjectSpec(key=f"f{i}", size_bytes=40 * MiB) for i in range(4)]
    with pytest.raises(grpc.RpcError) as e:
        s.Allocate(pb.AllocateRequest(objects=specs))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "arena full" in e.value.details()
    # Nothing of the failed batch stays allocated; the daemon keeps serving.
    s.Allocate(pb.AllocateRequest(objects=specs[:2]))


def test_malformed_message_and_daemon_stays_healthy(daemon):
    channel = grpc.insecure_channel(f"unix:{daemon.socket_path}")
    raw = channel.unary_unary("/kvtierd.v1.KVStore/Lookup")
    with pytest.raises(grpc.RpcError) as e:
        raw(b"\xff\xff\xff\xff garbage")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed request to /kvtierd.v1.KVStore/Lookup" in e.value.details()
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(channel)
    resp = health.Check(health_pb2.HealthCheckRequest(service="kvtierd.v1.KVStore"))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_lease_from_previous_instance_after_restart(start_daemon):
    d = start_daemon()
    with KVClient(d.socket_path) as c:
        c.put("p", b"persist" * 1000, durable=True)
        (lease,) = stub(d).Get(pb.GetRequest(keys=["p"])).leases
    assert d.stop() == 0
    assert not os.path.exists(d.socket_path), "socket removed on graceful shutdown"
    d.start()
    with pytest.raises(grpc.RpcError) as e:
        stub(d).Release(pb.ReleaseRequest(lease_ids=[lease.lease_id]))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "previous daemon instance" in e.value.details()
    with KVClient(d.socket_path) as c:  # the durable object survived, served from SSD
        assert c.lookup(["p"]).tiers == ("ssd",)
        assert bytes(c.get("p")) == b"persist" * 1000


def test_context_stored_already_compressed(client):
    # A client (the LMCache plugin) may store a context only in a compressed form.
    info = client.put("q", np.zeros(4096, np.int8), context_id="doc/int8", variant="int8")
    assert info.spec.variant == "int8" and info.tier == "cpu"
    assert client.lookup(["q"]).found == (True,)
    (ctx,) = [c for c in client.contexts() if c.context_id == "doc/int8"]
    assert ctx.variant == "int8"


def test_embedded_default_policy_is_evicpress(start_daemon):
    d = start_daemon(policy_file="")
    with KVClient(d.socket_path) as c:
        assert c.status().placer == "evicpress"
        c.put("x", b"y" * 100)
        assert c.lookup(["x"]).found == (True,)


def test_write_advice_over_the_socket(client):
    """Advise through the daemon: a held context's placement; a new one under an eviction-only
    placer stays the original; a query without a context id is refused."""
    client.put("advised/0", np.ones(1024, np.uint8), context_id="advised-ctx")
    held = client.advise("advised-ctx")
    assert (held.variant, held.tier, held.source) == ("none", "cpu", "placed")
    new = client.advise("never-seen", num_tokens=512, size_bytes=1 << 20)
    assert (new.variant, new.tier, new.source) == ("none", "", "default")
    assert "does not compress" in new.reason
    with pytest.raises(errors.InvalidArgumentError, match="context_id"):
        client.advise("")


def test_plan_is_advise_under_its_old_name(daemon, client):
    """Issue 17: the write advice was ``KVStore.Plan`` and ``KVClient.plan()``. For one release
    a plugin built before the rename keeps working: the daemon answers ``Plan`` (its own
    messages, as such a plugin sends them) with Advise's handler and logs once that it is
    deprecated; ``plan()`` returns ``advise()``'s answer and warns on its first call."""
    client.put("old/0", np.ones(1024, np.uint8), context_id="old-ctx")
    queries = [("old-ctx", 0, 0), ("never-seen", 512, 1 << 20)]
    advice = [client.advise(*q) for q in queries]
    old = pb.PlanRequest(
        contexts=[pb.PlanQuery(context_id=c, num_tokens=n, size_bytes=b) for c, n, b in queries]
    )
    for _ in range(2):
        plans = stub(daemon).Plan(old).plans
        assert [pb.WriteAdvice.FromString(p.SerializeToString()) for p in plans] == advice
    assert plans[0].source == "placed" and plans[1].source == "default"
    with pytest.raises(grpc.RpcError) as refused:
        stub(daemon).Plan(pb.PlanRequest(contexts=[pb.PlanQuery()]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert daemon.logs().count("a client called KVStore.Plan, deprecated") == 1
    with pytest.warns(DeprecationWarning, match=r"call advise\(\)") as warned:
        assert client.plan("old-ctx") == advice[0]
        assert client.plan("never-seen", num_tokens=512, size_bytes=1 << 20) == advice[1]
    assert len(warned) == 1


async def test_async_client_advises_and_plan_warns_once(daemon):
    async with AsyncKVClient(daemon.socket_path, timeout_s=20) as ac:
        advice = await ac.advise("never-seen", num_tokens=512, size_bytes=1 << 20)
        assert (advice.variant, advice.tier, advice.source) == ("none", "", "default")
        with pytest.warns(DeprecationWarning, match=r"call advise\(\)") as warned:
            assert await ac.plan("never-seen", 512, 1 << 20) == advice
            assert await ac.plan("never-seen", 512, 1 << 20) == advice
        assert len(warned) == 1


def test_a_wrong_client_checksum_is_refused_at_commit(daemon, client):
    """Issue 16 (7): a wrong checksum was accepted on a non-durable commit and served; the
    object then failed its SSD write (Drain("cpu") answered INVALID_ARGUMENT)."""
    import xxhash

    from kvtierd.client.buffers import ArenaMap

    data = os.urandom(256 << 10)
    right = xxhash.xxh3_64_intdigest(data)
    s = stub(daemon)
    arena = ArenaMap()
    try:
        for key, checksum in (("wrong", right ^ 1), ("right", right)):
            spec = pb.ObjectSpec(key=key, size_bytes=len(data), checksum=checksum)
            (alloc,) = s.Allocate(pb.AllocateRequest(objects=[spec])).allocations
            arena.region(alloc.region)[:] = data
            commit = pb.CommitRequest(allocation_ids=[alloc.allocation_id])
            if key == "wrong":
                with pytest.raises(grpc.RpcError) as refused:
                    s.Commit(commit)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
                assert "hash to" in refused.value.details()  # type: ignore[attr-defined]
            else:
                assert s.Commit(commit).objects[0].checksum == right
    finally:
        arena.close()
    parts = [pb.PutPart(spec=pb.ObjectSpec(key="streamed", size_bytes=8, checksum=1)),
             pb.PutPart(data=b"x" * 8)]  # fmt: skip
    with pytest.raises(errors.InvalidArgumentError, match="hash to"):
        client.call(client.kv.PutStream, iter(parts))
    assert client.lookup(["wrong", "right", "streamed"]).found == (False, True, False)
    assert client.status().allocations == 0  # the refused commit left nothing behind
    client.drain("cpu")
    assert bytes(client.get("right")) == data
