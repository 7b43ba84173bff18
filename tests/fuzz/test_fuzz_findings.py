"""What the fuzzer found, as deterministic reproducers (kept as regression tests).

The fuzzer sends the policy presets of configs/policies as ``ApplyPolicy`` documents. On a
daemon that held no context, the EvicPress placer's rebalance of an empty table raised
``ValueError: attempt to get argmax of an empty sequence`` -> ``INTERNAL`` (fixed in a672841's
series; kept as regression tests). A Rebalance under EvicPress dropped contexts that fit:
the engine gave unknown-length contexts a prefill time of 0 (fixed).
"""

from __future__ import annotations

import pytest

from kvtierd import errors
from kvtierd.client import KVClient
from kvtierd.rpc import kvtier_pb2 as pb
from tests.daemon_proc import REPO

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
