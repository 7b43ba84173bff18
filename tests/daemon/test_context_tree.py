"""Contexts that form a tree (issue 29), through a real daemon: a put after a shared prefix
starts a child, the prefix's context is split at the branch, a longer prompt still joins the
context it extends, and every bad parent link is refused by name."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvtierd import errors
from kvtierd.client import KVClient
from kvtierd.policies.precedence import MAX_DEPTH
from kvtierd.rpc import kvtier_pb2 as pb
from kvtierd.rpc import kvtier_pb2_grpc as pb_grpc

CHUNK = np.ones(4096, np.uint8)


@pytest.fixture
def daemon(start_daemon):
    return start_daemon(cpu="16MiB", ssd="64MiB")


@pytest.fixture
def client(daemon):
    with KVClient(daemon.socket_path, timeout_s=20) as c:
        yield c


def put_prompt(
    client: KVClient, keys: list[str], after: str = "", durable: bool = False
) -> pb.WriteAdvice:
    """What the LMCache plugin does for one put: ask which context the chunks join (from the
    chunk before the first one), then store them there."""
    advice = client.advise(keys[0], len(keys) * 256, len(keys) * CHUNK.size, after_key=after)
    for key in keys:
        client.put(key, CHUNK, context_id=advice.context_id, durable=durable,
                   parent_context_id=advice.parent_context_id)  # fmt: skip
    return advice


def tree(client: KVClient) -> dict[str, tuple[str, int]]:
    """context -> (parent, objects)."""
    return {c.context_id: (c.parent_context_id, c.objects) for c in client.contexts()}


def test_three_documents_after_one_system_prompt_make_a_tree(client):
    system = ["s0", "s1", "s2"]
    first = put_prompt(client, [*system, "a0", "a1"])
    assert (first.context_id, first.parent_context_id) == ("s0", "")
    assert tree(client) == {"s0": ("", 5)}

    second = put_prompt(client, ["b0", "b1"], after="s2")  # branches after the shared prefix
    assert (second.context_id, second.parent_context_id) == ("b0", "s0")
    # the first request's context was split at the branch: its document is a child now
    assert tree(client) == {"s0": ("", 3), "a0": ("s0", 2), "b0": ("s0", 2)}

    third = put_prompt(client, ["c0"], after="s2")  # a child already branches there
    assert (third.context_id, third.parent_context_id) == ("c0", "s0")
    # a longer prompt (or chunked prefill's next put) extends its context and joins it
    more = put_prompt(client, ["b2", "b3"], after="b1")
    assert (more.context_id, more.parent_context_id) == ("b0", "s0")
    assert tree(client) == {
        "s0": ("", 3), "a0": ("s0", 2), "b0": ("s0", 4), "c0": ("s0", 1),
    }  # fmt: skip
    root = next(c for c in client.contexts() if c.context_id == "s0")
    assert root.children == 3


def test_a_branch_inside_a_child_splits_the_child(client):
    put_prompt(client, ["s0", "s1", "a0", "a1", "a2"])
    put_prompt(client, ["b0"], after="s1")
    put_prompt(client, ["x0"], after="a1")  # a prompt sharing the system prompt and a0, a1
    assert tree(client) == {
        "s0": ("", 2), "a0": ("s0", 2), "a2": ("a0", 1), "b0": ("s0", 1), "x0": ("a0", 1),
    }  # fmt: skip


def test_describe_gives_ancestors_descendants_and_why_tokens_are_not_dropped(daemon, client):
    put_prompt(client, ["s0", "s1", "a0", "a1"])
    put_prompt(client, ["b0"], after="s1")
    put_prompt(client, ["x0"], after="a0")
    admin = pb_grpc.AdminStub(grpc.insecure_channel(f"unix:{daemon.socket_path}"))
    leaf = admin.DescribeContext(pb.DescribeContextRequest(context_id="x0"))
    assert list(leaf.ancestors) == ["a0", "s0"]
    assert "continues context 'a0'" in leaf.summary.token_drop_refused
    top = admin.DescribeContext(pb.DescribeContextRequest(context_id="s0"))
    assert list(top.ancestors) == []
    assert [d.context_id for d in top.descendants] == ["a0", "b0", "a1", "x0"]
    assert "2 context(s) continue it" in top.summary.token_drop_refused


def test_deleting_a_parent_drops_the_link(client):
    put_prompt(client, ["s0", "a0"])
    put_prompt(client, ["b0"], after="s0")
    assert client.evict(["s0"]) == 1
    assert tree(client) == {"a0": ("", 1), "b0": ("", 1)}


def test_bad_parents_are_refused_by_name(client):
    put_prompt(client, ["s0", "a0"])
    put_prompt(client, ["b0"], after="s0")
    with pytest.raises(errors.NotFoundError, match="parent context 'nope' is not held"):
        client.put("k", CHUNK, context_id="new", parent_context_id="nope")
    with pytest.raises(errors.InvalidArgumentError, match="would make a cycle"):
        client.put("s9", CHUNK, context_id="s0", parent_context_id="b0")
    with pytest.raises(errors.InvalidArgumentError, match="cannot be its own parent"):
        client.put("k", CHUNK, context_id="self", parent_context_id="self")
    with pytest.raises(errors.InvalidArgumentError, match="after_key must be at most"):
        client.advise("x", after_key="k" * 2000)
    assert tree(client) == {"s0": ("", 1), "a0": ("s0", 1), "b0": ("s0", 1)}


def test_a_chain_deeper_than_the_limit_is_refused(client):
    client.put("d0", CHUNK, context_id="d0")
    for depth in range(1, MAX_DEPTH + 1):
        client.put(f"d{depth}", CHUNK, context_id=f"d{depth}", parent_context_id=f"d{depth - 1}")
    with pytest.raises(errors.InvalidArgumentError, match=f"at most {MAX_DEPTH} levels"):
        client.put("deep", CHUNK, context_id="deep", parent_context_id=f"d{MAX_DEPTH}")


def test_another_tenants_context_is_no_parent(start_daemon):
    d = start_daemon(cpu="16MiB", tenants=[{"name": "a"}, {"name": "b"}])
    with KVClient(d.socket_path, tenant="a") as a, KVClient(d.socket_path, tenant="b") as b:
        a.put("p0", CHUNK, context_id="p0")
        with pytest.raises(errors.NotFoundError, match="parent context 'b/p0' is not held"):
            b.put("k", CHUNK, context_id="mine", parent_context_id="p0")
        a.put("k", CHUNK, context_id="mine", parent_context_id="p0")  # its own: accepted


def test_the_tree_survives_a_restart(daemon):
    """Each child's objects carry its parent onto the persistent tier. The split of the first
    request's context is in memory only: after a restart its document rejoins the prefix's
    context (module docstring of engine/segments.py), and the later branches stay its
    children."""
    with KVClient(daemon.socket_path, timeout_s=20) as c:
        put_prompt(c, ["s0", "s1", "a0"], durable=True)
        put_prompt(c, ["b0", "b1"], after="s1", durable=True)
        put_prompt(c, ["c0"], after="s1", durable=True)
        assert tree(c) == {"s0": ("", 2), "a0": ("s0", 1), "b0": ("s0", 2), "c0": ("s0", 1)}
    assert daemon.stop() == 0
    daemon.start()
    with KVClient(daemon.socket_path, timeout_s=20) as c:
        assert tree(c) == {"s0": ("", 3), "b0": ("s0", 2), "c0": ("s0", 1)}
