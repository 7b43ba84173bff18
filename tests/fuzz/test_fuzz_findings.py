"""What the fuzzer found, as deterministic reproducers (kept as regression tests).

The fuzzer sends the policy presets of configs/policies as ``ApplyPolicy`` documents. On a
daemon that held no context, the EvicPress placer's rebalance of an empty table raised
``ValueError: attempt to get argmax of an empty sequence`` -> ``INTERNAL`` (fixed in a672841's
series; kept as regression tests). A Rebalance under EvicPress dropped contexts that fit:
the engine gave unknown-length contexts a prefill time of 0 (fixed).
"""

from __future__ import annotations

import time

import grpc
import pytest

from benchmarks._support.daemon_proc import REPO
from kvtierd import errors
from kvtierd.client import KVClient
from kvtierd.rpc import kvtier_pb2 as pb
from tests.fuzz.proto_strategies import ALIAS_BOMB

PRESETS = sorted(p.name for p in (REPO / "configs/policies").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_apply_each_preset_to_an_empty_daemon(start_daemon, preset):
    d = start_daemon(cpu="16MiB", ssd="64MiB")
    text = (REPO / "configs/policies" / preset).read_text()
    with KVClient(d.socket_path, timeout_s=10) as c:
        reply = c.call(c.admin.ApplyPolicy, pb.ApplyPolicyRequest(yaml=text, source=preset))
        assert reply.source == preset
        assert c.status().health == "SERVING"


def test_rebalance_an_empty_daemon_under_evicpress(start_daemon):
    d = start_daemon(policy_file=str(REPO / "configs/policies/evicpress.yaml"))
    with KVClient(d.socket_path, timeout_s=10) as c:
        reply = c.call(c.admin.Rebalance, pb.RebalanceRequest())
        assert reply.operations == 0


def test_rebalance_under_evicpress_keeps_a_context_that_fits(start_daemon):
    """64 MiB of CPU tier for one 4 KiB context: nothing forces it out."""
    d = start_daemon(policy_file=str(REPO / "configs/policies/evicpress.yaml"))
    with KVClient(d.socket_path, timeout_s=10) as c:
        c.put("k", b"x" * 4096, context_id="ctx")
        c.call(c.admin.Rebalance, pb.RebalanceRequest())
        assert c.lookup(["k"]).found == (True,)
        assert bytes(c.get("k")) == b"x" * 4096


def test_invalid_policy_is_refused_and_changes_nothing(start_daemon):
    d = start_daemon()
    with KVClient(d.socket_path, timeout_s=10) as c:
        c.put("k", b"x" * 4096, context_id="ctx")
        with pytest.raises(errors.InvalidArgumentError):
            c.call(c.admin.ApplyPolicy, pb.ApplyPolicyRequest(yaml="placer: nonsense"))
        c.call(c.admin.Rebalance, pb.RebalanceRequest())
        assert c.call(c.admin.GetPolicy, pb.PolicyRequest()).name == "lru"
        assert bytes(c.get("k")) == b"x" * 4096


# Issue 16's hostile requests, each with the status it must now get (the fuzzer's strategies
# draw the same values: a 1e300 lease, part_bytes=1, a long token list, an alias bomb).
ISSUE_16 = [
    ("lease_s 1e300", "Get", pb.GetRequest(keys=["k"], lease_s=1e300), "INVALID_ARGUMENT"),
    ("hold_s inf", "Lookup", pb.LookupRequest(keys=["k"], hold_s=float("inf")),
     "INVALID_ARGUMENT"),
    ("part_bytes 1", "GetStream", pb.GetStreamRequest(key="k", part_bytes=1),
     "INVALID_ARGUMENT"),
    ("tokens of an unknown context", "SetContextTokens",
     pb.SetContextTokensRequest(context_id="nowhere", token_ids=[1, 2]), "NOT_FOUND"),
    ("2**20 + 1 tokens", "SetContextTokens",
     pb.SetContextTokensRequest(request_id="r", token_ids=[7] * ((1 << 20) + 1)),
     "INVALID_ARGUMENT"),
    ("the default tenant reads t1/...", "Get", pb.GetRequest(keys=["t1/k"]),
     "PERMISSION_DENIED"),
    ("the default tenant plants t1/...", "Allocate",
     pb.AllocateRequest(objects=[pb.ObjectSpec(key="t1/planted", size_bytes=8)]),
     "PERMISSION_DENIED"),
    ("an alias bomb", "ApplyPolicy", pb.ApplyPolicyRequest(yaml=ALIAS_BOMB), "INVALID_ARGUMENT"),
]  # fmt: skip


@pytest.mark.parametrize(("method", "request_", "code"), [c[1:] for c in ISSUE_16],
                         ids=[c[0] for c in ISSUE_16])  # fmt: skip
def test_issue_16_requests_get_a_clean_answer(start_daemon, method, request_, code):
    d = start_daemon(tenants=[{"name": "t1"}])
    with KVClient(d.socket_path, timeout_s=10) as c:
        c.put("k", b"x" * (64 << 10))
        with KVClient(d.socket_path, tenant="t1") as t1:
            t1.put("k", b"t1's")
        service = c.admin if method == "ApplyPolicy" else c.kv
        call = getattr(service, method)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            reply = call(request_, timeout=10)
            if method == "GetStream":
                list(reply)
        assert refused.value.code().name == code, refused.value.details()
        assert time.monotonic() - started < 5.0
        assert c.status().health == "SERVING" and c.status().leases == 0


def test_a_wrong_checksum_is_refused_and_the_tier_drains(start_daemon):
    d = start_daemon()
    with KVClient(d.socket_path, timeout_s=10) as c:
        spec = pb.ObjectSpec(key="wrong", size_bytes=8, checksum=12345)
        parts = [pb.PutPart(spec=spec), pb.PutPart(data=b"x" * 8)]
        with pytest.raises(errors.InvalidArgumentError, match="hash to"):
            c.call(c.kv.PutStream, iter(parts))
        c.put("right", b"y" * 8)
        assert c.drain("cpu").moved == 1  # a wrong checksum once made this INVALID_ARGUMENT
