"""Namespaces inside a tenant (issue 41.2): keys ``ns:<name>:...`` (the LMCache plugin makes
them from a request's ``cache_salt``) are charged to the namespace the daemon's YAML
configures, with its own quota per tier and metrics; one namespace filling its quota never
moves another's contexts out of their tier; names and counts a client or a YAML gives are
checked."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import yaml

from benchmarks._support.daemon_proc import DaemonProcess, metrics_port
from kvtierd import errors, namespaces
from kvtierd.client import KVClient
from kvtierd.config import DaemonConfig, NamespaceConfig, TierConfig, load_daemon_config
from kvtierd.engine import Engine
from kvtierd.engine.index import ContextIndex
from kvtierd.kernels.chunk_codec import ChunkFormat
from kvtierd.rpc import kvtier_pb2 as pb
from kvtierd.types import ORIGINAL_VARIANT, ObjectMeta, Operation, OpKind, Placement
from tests.cli.test_metrics_endpoint import scrape

MiB = 1 << 20
SPACES = [
    {"name": "team-a", "quota": {"cpu": "1MiB", "ssd": "2MiB"}},
    {"name": "team-b", "quota": {"cpu": "2MiB"}},
]


def _settle(c: KVClient) -> None:
    deadline = time.monotonic() + 10
    while c.status().pending_plans and time.monotonic() < deadline:
        time.sleep(0.01)


def _tiers(c: KVClient) -> dict[str, str]:
    return {ctx.context_id: ctx.tier for ctx in c.contexts()}


def _put_mib(c: KVClient, team: str, i: int, fill: int) -> None:
    """Context ``ns:<team>:u@c<i>`` of one MiB object filled with ``fill``."""
    c.put(f"ns:{team}:u@{i}", np.full(MiB, fill, np.uint8), context_id=f"ns:{team}:u@c{i}")


def test_a_namespace_filling_its_quota_never_moves_anothers(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    # The CPU tier holds team-b's 2 MiB and team-a's 1 MiB exactly: team-a's later contexts
    # are newer (LRU would make room for them by moving team-b's down) but over its CPU quota.
    tenants = [{"name": "t", "namespaces": [{"name": "team-a", "quota": {"cpu": "1MiB"}}]}]
    d = start_daemon(
        cpu="3MiB", ssd="16MiB", namespaces=SPACES, tenants=tenants, metrics_port="any"
    )
    with KVClient(d.socket_path) as c:
        for i in range(2):
            _put_mib(c, "team-b", i, fill=i)
        _settle(c)
        for i in range(3):
            _put_mib(c, "team-a", i, fill=9)
            _settle(c)
        tiers = _tiers(c)
        assert tiers["ns:team-b:u@c0"] == tiers["ns:team-b:u@c1"] == "cpu", tiers
        team_a = sorted(t for ctx, t in tiers.items() if ctx.startswith("ns:team-a:"))
        assert team_a == ["cpu", "ssd", "ssd"], tiers
        with pytest.raises(errors.CapacityError, match="namespace 'team-a' of tenant '' quota"):
            c.put("ns:team-a:u@3", np.zeros(MiB, np.uint8), context_id="ns:team-a:u@c3")
        # team-b's own contexts read back as they were
        for i in range(2):
            assert np.array_equal(c.get(f"ns:team-b:u@{i}"), np.full(MiB, i, np.uint8))
    got = scrape(metrics_port(d))

    def row(name: str, space: str, tier: str) -> float:
        labels = (("namespace", space), ("tenant", ""), ("tier", tier))
        return got[(f"kvtierd_namespace_{name}_bytes", labels)]

    assert row("used", "team-a", "cpu") == MiB and row("used", "team-a", "ssd") == 2 * MiB
    assert row("used", "team-b", "cpu") == 2 * MiB and row("used", "team-b", "ssd") == 0
    assert row("quota", "team-a", "cpu") == MiB and row("quota", "team-b", "ssd") == -1
    # Tenant t's namespace team-a is its own; the default tenant's is another.
    with KVClient(d.socket_path, tenant="t") as t:
        t.put("ns:team-a:u@0", np.zeros(MiB // 2, np.uint8), context_id="ns:team-a:u@c0")
        with pytest.raises(errors.CapacityError, match="namespace 'team-a' of tenant 't'"):
            t.put("ns:team-a:u@1", np.zeros(MiB, np.uint8), context_id="ns:team-a:u@c1")
    # A key naming no configured namespace is the tenant's, outside every namespace quota,
    # and makes no metric labels.
    with KVClient(d.socket_path) as c:
        c.put("ns:team-z:u@0", np.zeros(4 * MiB, np.uint8), context_id="ns:team-z:u@c0")
    assert not [k for k in scrape(metrics_port(d)) if ("namespace", "team-z") in k[1]]


def _used(d: DaemonProcess, space: str, tier: str) -> float:
    labels = (("namespace", space), ("tenant", ""), ("tier", tier))
    return scrape(metrics_port(d))[("kvtierd_namespace_used_bytes", labels)]


def test_concurrent_puts_count_a_namespaces_bytes_in_flight(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """Six puts of 1 MiB into team-a (quota 1 MiB cpu + 2 MiB ssd) allocate before any of them
    commits: bytes being put count against the namespace's quota as they do against a
    tenant's, so three are refused at Allocate. Counted only once stored, all six were
    accepted and three then dropped by the executor (acknowledged, then gone)."""
    d = start_daemon(cpu="3MiB", ssd="16MiB", namespaces=SPACES, metrics_port="any")
    with KVClient(d.socket_path) as c:
        for i in range(2):
            c.put(f"ns:team-b:u@{i}", np.full(MiB, i, np.uint8), context_id=f"ns:team-b:u@c{i}")
        _settle(c)
    puts = 6
    all_allocated = threading.Barrier(puts, timeout=60)
    stored: list[str] = []
    refused: list[str] = []

    def put(i: int) -> None:
        key = f"ns:team-a:p@{i}"
        spec = pb.ObjectSpec(key=key, size_bytes=MiB, context_id=f"ns:team-a:p@c{i}")
        with KVClient(d.socket_path) as c:
            try:
                allocs = c.call(c.kv.Allocate, pb.AllocateRequest(objects=[spec])).allocations
            except errors.CapacityError as e:
                refused.append(str(e))
                allocs = []
            all_allocated.wait()  # every Allocate before any Commit
            if allocs:
                c.call(c.kv.Commit, pb.CommitRequest(allocation_ids=[allocs[0].allocation_id]))
                stored.append(key)

    threads = [threading.Thread(target=put, args=(i,)) for i in range(puts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (len(stored), len(refused)) == (3, 3), (stored, refused)
    assert all("namespace 'team-a' of tenant '' quota exceeded" in e for e in refused), refused
    with KVClient(d.socket_path) as c:
        _settle(c)
        assert c.lookup(stored).found == (True,) * 3  # every acknowledged put is kept
        tiers = _tiers(c)
        assert tiers["ns:team-b:u@c0"] == tiers["ns:team-b:u@c1"] == "cpu", tiers
        for i in range(2):
            assert np.array_equal(c.get(f"ns:team-b:u@{i}"), np.full(MiB, i, np.uint8))
    assert _used(d, "team-a", "cpu") <= MiB and _used(d, "team-a", "ssd") <= 2 * MiB
    assert _used(d, "team-a", "cpu") + _used(d, "team-a", "ssd") == 3 * MiB


AS_PUT = {"ns:team-b:u@c0": "cpu", "ns:team-b:u@c1": "cpu",
          "ns:team-a:u@c0": "cpu", "ns:team-a:u@c1": "ssd"}  # fmt: skip


def _team_a_full_in_cpu(c: KVClient) -> None:
    """Two team-b contexts then two team-a ones of 1 MiB each in a 3 MiB CPU tier: team-a's
    CPU quota (1 MiB) takes its first; its second goes to the SSD tier."""
    for team, fill in (("team-b", None), ("team-a", 9)):
        for i in range(2):
            _put_mib(c, team, i, fill=i if fill is None else fill)
            _settle(c)
    assert _tiers(c) == AS_PUT


def test_a_promotion_never_moves_anothers_context_for_a_full_namespace(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """team-a's CPU quota (1 MiB) is full and its second context sits in the SSD tier. A hit
    on it makes LRU promote it to the CPU tier, moving the least recently used context there
    (team-b's) down to make room; the namespace's quota then keeps it out. The placer must see
    the namespace's full tier as closed to that context, as at its first placement: nothing
    moves, and team-a is never over its quota in the CPU tier."""
    d = start_daemon(cpu="3MiB", ssd="16MiB", namespaces=SPACES, metrics_port="any")
    with KVClient(d.socket_path) as c:
        _team_a_full_in_cpu(c)
        for _ in range(3):
            assert np.array_equal(c.get("ns:team-a:u@1"), np.full(MiB, 9, np.uint8))
            _settle(c)
        assert _tiers(c) == AS_PUT
    assert _used(d, "team-a", "cpu") == MiB


def test_a_rebalance_never_moves_anothers_context_for_a_full_namespace(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """As above, then a rebalance: LRU re-places every context by recency, team-a's second
    context (read last) first in the CPU tier, moving team-b's oldest down for it; the
    executor then kept team-a's out by its quota, and team-b's context stayed down for
    nothing. The rebalance is told each context's fastest tier under its quota."""
    d = start_daemon(cpu="3MiB", ssd="16MiB", namespaces=SPACES, metrics_port="any")
    with KVClient(d.socket_path) as c:
        _team_a_full_in_cpu(c)
        c.get("ns:team-a:u@1")
        _settle(c)
        c.call(c.admin.Rebalance, pb.RebalanceRequest())
        _settle(c)
        assert _tiers(c) == AS_PUT
    assert _used(d, "team-a", "cpu") == MiB


async def _put_chunks(engine: Engine, cid: str, chunks: int = 4) -> None:
    """A context of LMCache chunks (``[2, L, T, H*D]`` bfloat16, 8 KiB each)."""
    shape, g = (2, 2, 16, 64), np.random.default_rng(0)
    layout = ChunkFormat(shape, "bfloat16", 2).layout()
    for i in range(chunks):
        data = g.standard_normal(shape, np.float32).astype(np.float32).view(np.uint32) >> 16
        raw = memoryview(data.astype(np.uint16).tobytes())
        await engine.put_bytes(ObjectMeta(key=f"{cid}-{i}@bfloat16", size_bytes=len(raw),
                                          context_id=cid, dtype="bfloat16", shape=shape,
                                          layout=layout, token_count=16), raw)  # fmt: skip


async def test_a_compression_into_a_faster_tier_keeps_to_the_namespace_quota(
    tmp_path: Path,
) -> None:
    """A plan that compresses a context into a faster tier moves it there too: the executor
    checked a plain move against the tenant's and namespace's quotas, but wrote a compressed
    form wherever the plan said. team-a's CPU quota holds one 32 KiB context; its second, in
    the SSD tier, planned as int8 in the CPU tier, is compressed where the quota allows."""
    lru = tmp_path / "lru.yaml"
    lru.write_text("name: lru\nplacer: lru\n")
    config = DaemonConfig(
        socket_path=str(tmp_path / "s"), data_dir=str(tmp_path / "data"), policy_file=str(lru),
        tiers=(TierConfig("cpu", "cpu", 1 << 20, options={"staging_bytes": "32MiB"}),
               TierConfig("ssd", "ssd", 8 << 20, str(tmp_path / "ssd"))),
        namespaces=(NamespaceConfig("team-a", {"cpu": 32 << 10, "ssd": 1 << 20}),),
    )  # fmt: skip
    engine = Engine(config)
    await engine.start()
    try:
        for i in range(2):
            await _put_chunks(engine, f"ns:team-a:c{i}")
            await engine.executor.idle()
        ctx = engine.contexts["ns:team-a:c1"]
        assert engine.index.placement_of(ctx).tier == "ssd"
        where = Placement(ORIGINAL_VARIANT, "ssd")
        await engine.executor.apply(Operation(OpKind.COMPRESS, ctx.context_id, where,
                                              Placement("int8", "cpu")))  # fmt: skip
        await engine.executor.idle()
        assert engine.index.placement_of(ctx) == Placement("int8", "ssd")
        assert engine.index.namespace_usage["", "team-a", "cpu"] == 32 << 10
        assert engine.placing.target(ctx.context_id) == Placement("int8", "ssd")
    finally:
        await engine.close()


def _meta(key: str, size: int = 100, tenant: str = "") -> ObjectMeta:
    return ObjectMeta(key=key, size_bytes=size, tenant=tenant)


def test_only_a_well_formed_key_of_a_configured_namespace_is_charged_to_it() -> None:
    index = ContextIndex(namespace_quotas={"": {"a": {"cpu": 10}}, "t": {"b": {}}})
    assert index.namespace_of(_meta("ns:a:x")) == "a"
    assert index.namespace_of(_meta("t/ns:b:x", tenant="t")) == "b"
    for key in ("ns:a", "ns::x", "ns:zz:x", "xns:a:x", "ns:" + "a" * 65 + ":x", "ns:a/b:x"):
        assert index.namespace_of(_meta(key)) == "", key
    assert index.namespace_of(_meta("ns:b:x")) == ""  # b is tenant t's, not the default's
    assert index.namespace_of(_meta("t/ns:a:x", tenant="t")) == ""
    assert namespaces.named_in("ns:a:x") == "a"


@pytest.mark.parametrize(
    ("namespaces_yaml", "message"),
    [
        ({"name": "a"}, "must be a list of namespaces"),
        ([{"quota": {}}], "a mapping with a name"),
        ([{"name": "a/b"}], r"'a/b': namespace names are 1-64 of"),
        ([{"name": "a:b"}], r"'a:b': namespace names are"),
        ([{"name": 7}], r"7: namespace names are"),
        ([{"name": "a"}, {"name": "a"}], "namespace 'a' named twice"),
        ([{"name": "a", "quota": {"tape": "1MiB"}}], "unknown tier 'tape'"),
        ([{"name": "a", "quota": {"cpu": "lots"}}], "cpu"),
        ([{"name": "a", "limit": 1}], "unknown key; allowed keys: name, quota"),
        ([{"name": f"n{i}"} for i in range(257)], "257 namespaces; a tenant may have at most 256"),
    ],
)
def test_bad_namespaces_are_refused_at_load(
    tmp_path: Path, namespaces_yaml: object, message: str
) -> None:
    doc = {
        "socket_path": str(tmp_path / "s.sock"),
        "data_dir": str(tmp_path / "data"),
        "tiers": [{"name": "cpu", "kind": "cpu", "capacity": "8MiB"}],
        "tenants": [{"name": "t", "namespaces": namespaces_yaml}],
    }
    for where in (doc, {**{k: v for k, v in doc.items() if k != "tenants"},
                        "namespaces": namespaces_yaml}):  # fmt: skip
        path = tmp_path / "kvtierd.yaml"
        path.write_text(yaml.safe_dump(where))
        with pytest.raises(errors.ConfigError, match=message):
            load_daemon_config(path)


def test_namespaces_load_for_the_default_tenant_and_a_tenant(tmp_path: Path) -> None:
    path = tmp_path / "kvtierd.yaml"
    path.write_text(yaml.safe_dump({
        "socket_path": str(tmp_path / "s.sock"), "data_dir": str(tmp_path / "data"),
        "tiers": [{"name": "cpu", "kind": "cpu", "capacity": "8MiB"}],
        "namespaces": [{"name": "team-a", "quota": {"cpu": "1MiB"}}],
        "tenants": [{"name": "t", "namespaces": [{"name": "team-a"}]}],
    }))  # fmt: skip
    config = load_daemon_config(path)
    assert [(n.name, n.quota_bytes) for n in config.namespaces] == [("team-a", {"cpu": MiB})]
    assert [(n.name, n.quota_bytes) for n in config.tenants[0].namespaces] == [("team-a", {})]
