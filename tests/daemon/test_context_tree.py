"""Contexts that form a tree (issue 29), through a real daemon: a put after a shared prefix
starts a child, the prefix's context is split at the branch, a longer prompt still joins the
context it extends, and every bad parent link is refused by name."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

from kvtierd import errors
from kvtierd.client import KVClient
from kvtierd.policies.tree_placement import MAX_DEPTH
from kvtierd.rpc import kvtier_pb2 as pb
from kvtierd.rpc import kvtier_pb2_grpc as pb_grpc
from kvtierd.storage.ssd_format import decode_header, encode_header
from kvtierd.types import ObjectMeta

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


def _depths(client: KVClient) -> dict[str, int]:
    parents = {c: p for c, (p, _) in tree(client).items()}

    def depth(cid: str) -> int:
        return 0 if not parents.get(cid) else 1 + depth(parents[cid])

    return {cid: depth(cid) for cid in parents}


def test_splits_keep_the_depth_limit(client):
    """Issue 40.4: each Advise after chunk i of a chain splits the chunks after it into a child
    one level deeper; 79 of them made a chain of 79, and every Rebalance failed after."""
    keys = [f"c{i}" for i in range(MAX_DEPTH + 16)]
    put_prompt(client, keys)
    for i, key in enumerate(keys[:-1]):
        client.advise(f"branch{i}", 256, CHUNK.size, after_key=key)
    assert max(_depths(client).values()) <= MAX_DEPTH
    client.call(client.admin.Rebalance, pb.RebalanceRequest())  # the whole tree is valid
    assert client.lookup(keys).found == (True,) * len(keys)


def test_one_advise_splits_at_most_the_depth_limit(client):
    keys = [f"c{i}" for i in range(MAX_DEPTH + 16)]
    put_prompt(client, keys)
    queries = [
        pb.AdviseQuery(
            context_id=f"branch{i}", num_tokens=256, size_bytes=CHUNK.size, after_key=key
        )
        for i, key in enumerate(keys[:-1])
    ]
    with pytest.raises(errors.InvalidArgumentError, match=f"at most {MAX_DEPTH}"):
        client.call(client.kv.Advise, pb.AdviseRequest(contexts=queries))
    assert _depths(client) == {"c0": 0}  # nothing split
    client.call(client.kv.Advise, pb.AdviseRequest(contexts=queries[:MAX_DEPTH]))


def _written_bytes(pid: int) -> int:
    """What the process wrote through write calls so far (``wchar``: O_DIRECT writes too)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar in /proc/PID/io")


def test_one_advise_rewrites_each_moved_chunk_at_most_once(start_daemon):
    """Issue 40.5: every split rewrote each moved chunk's whole SSD file, and queries after
    chunks 0, 1, 2, ... moved the shrinking tail each time: N(N-1)/2 rewrites (60 durable
    chunks of 256 KiB, one 59-query Advise: 450 MiB written for 15 MiB stored). One Advise
    writes each moved chunk's file at most once now."""
    d = start_daemon(cpu="64MiB", ssd="256MiB")
    chunk = np.ones(256 << 10, np.uint8)
    keys = [f"c{i}" for i in range(60)]
    with KVClient(d.socket_path, timeout_s=60) as c:
        for key in keys:  # durable: each chunk has its SSD file
            c.put(key, chunk, context_id="c0", durable=True)
        stored = len(keys) * chunk.size
        assert d.proc is not None
        before = _written_bytes(d.proc.pid)
        queries = [
            pb.AdviseQuery(context_id=f"b{i}", num_tokens=256, size_bytes=chunk.size, after_key=key)
            for i, key in enumerate(keys[:-1])
        ]
        c.call(c.kv.Advise, pb.AdviseRequest(contexts=queries))
        written = _written_bytes(d.proc.pid) - before
        assert len(tree(c)) == len(keys)  # split after every chunk
        assert written <= 2 * stored, f"{written / 2**20:.1f} MiB written for {stored >> 20} MiB"
    d.kill()
    d.start()  # the splits were saved: a restart finds the same tree
    with KVClient(d.socket_path, timeout_s=60) as c:
        assert len(tree(c)) == len(keys)


def test_another_tenants_context_is_no_parent(start_daemon):
    d = start_daemon(cpu="16MiB", tenants=[{"name": "a"}, {"name": "b"}])
    with KVClient(d.socket_path, tenant="a") as a, KVClient(d.socket_path, tenant="b") as b:
        a.put("p0", CHUNK, context_id="p0")
        with pytest.raises(errors.NotFoundError, match="parent context 'b/p0' is not held"):
            b.put("k", CHUNK, context_id="mine", parent_context_id="p0")
        a.put("k", CHUNK, context_id="mine", parent_context_id="p0")  # its own: accepted


def _files(daemon) -> dict[str, tuple[Path, ObjectMeta]]:
    """The SSD tier's object files by key (the persistent copies a restart reads)."""
    out = {}
    for path in (Path(daemon.config).parent / "ssd" / "objects").glob("*/*.kvt"):
        meta = decode_header(path.read_bytes()[:65536], str(path)).meta
        out[meta.key] = (path, meta)
    return out


def _rewrite(path: Path, meta: ObjectMeta) -> None:
    """Give an object file another header, its data kept (what another build would write)."""
    raw = path.read_bytes()
    old_len = len(encode_header(decode_header(raw[:65536], str(path)).meta))
    path.write_bytes(encode_header(meta) + raw[old_len:])


def _split_tree(c: KVClient) -> dict[str, tuple[str, int]]:
    """The first request's context is split by the second (its document ``a0`` moves to a
    child); ``k0`` named the prefix as its parent after its end, so it follows the moved part."""
    put_prompt(c, ["s0", "s1", "a0"], durable=True)
    c.put("k0", CHUNK, context_id="k0", parent_context_id="s0", durable=True)
    put_prompt(c, ["b0", "b1"], after="s1", durable=True)
    put_prompt(c, ["c0"], after="s1", durable=True)
    return tree(c)


def test_the_tree_survives_a_restart(daemon):
    """Each child's objects carry its parent onto the persistent tier, and a split rewrites
    the persistent copies of what it changed (engine/tree_joins.py): after a restart the
    prefix, the part split off it, the children that followed that part and the later
    branches are as they were."""
    with KVClient(daemon.socket_path, timeout_s=20) as c:
        before = _split_tree(c)
    assert before == {
        "s0": ("", 2), "a0": ("s0", 1), "k0": ("a0", 1), "b0": ("s0", 2), "c0": ("s0", 1),
    }  # fmt: skip
    files = _files(daemon)
    assert (files["a0"][1].context_id, files["a0"][1].parent_context_id) == ("a0", "s0")
    assert files["k0"][1].parent_context_id == "a0"
    assert daemon.stop() == 0
    daemon.start()
    with KVClient(daemon.socket_path, timeout_s=20) as c:
        assert tree(c) == before
        again = put_prompt(c, ["d0"], after="s1")  # the restarted daemon branches there too
        assert (again.context_id, again.parent_context_id) == ("d0", "s0")


def test_a_split_inside_a_child_survives_a_restart(daemon):
    with KVClient(daemon.socket_path, timeout_s=20) as c:
        put_prompt(c, ["s0", "s1", "a0", "a1", "a2"], durable=True)
        put_prompt(c, ["b0"], after="s1", durable=True)
        put_prompt(c, ["x0"], after="a1", durable=True)
        before = tree(c)
    assert before == {
        "s0": ("", 2), "a0": ("s0", 2), "a2": ("a0", 1), "b0": ("s0", 1), "x0": ("a0", 1),
    }  # fmt: skip
    assert daemon.stop() == 0
    daemon.start()
    with KVClient(daemon.socket_path, timeout_s=20) as c:
        assert tree(c) == before


def test_files_from_before_splits_were_kept_still_load(daemon):
    """Files a daemon wrote before splits were made durable: the moved chunk still names the
    prefix's context and no parent. They load, as that daemon found them: the prefix whole,
    the later branches its children."""
    with KVClient(daemon.socket_path, timeout_s=20) as c:
        _split_tree(c)
    assert daemon.stop() == 0
    for key in ("a0", "k0"):
        path, meta = _files(daemon)[key]
        old = {"a0": ("s0", ""), "k0": ("k0", "s0")}[key]
        _rewrite(path, meta.replace(context_id=old[0], parent_context_id=old[1]))
    daemon.start()
    with KVClient(daemon.socket_path, timeout_s=20) as c:
        assert tree(c) == {"s0": ("", 3), "k0": ("s0", 1), "b0": ("s0", 2), "c0": ("s0", 1)}


def test_a_file_naming_a_hostile_parent_is_refused_by_name(daemon):
    """A header read back from the disk is checked as a put is: a context that names itself
    as its parent is refused (the file quarantined, the reason logged with the field and
    what is allowed), and the rest of the tree loads."""
    with KVClient(daemon.socket_path, timeout_s=20) as c:
        _split_tree(c)
    assert daemon.stop() == 0
    path, meta = _files(daemon)["c0"]
    _rewrite(path, meta.replace(parent_context_id="c0"))
    daemon.start()
    with KVClient(daemon.socket_path, timeout_s=20) as c:
        assert tree(c) == {
            "s0": ("", 2), "a0": ("s0", 1), "k0": ("a0", 1), "b0": ("s0", 2),
        }  # fmt: skip
    logs = daemon.logs()
    assert "parent_context_id 'c0' is the object's own context" in logs
    assert "Traceback" not in logs


def test_a_copy_that_cannot_be_relabelled_does_not_fail_the_put(daemon):
    """The split holds in memory and the put goes on; the copy that could not be rewritten
    is logged by name (a restart finds it in the prefix's context)."""
    with KVClient(daemon.socket_path, timeout_s=20) as c:
        put_prompt(c, ["s0", "s1", "a0"], durable=True)
        _files(daemon)["a0"][0].unlink()  # lost under the daemon
        joins = put_prompt(c, ["b0"], after="s1")
        assert (joins.context_id, joins.parent_context_id) == ("b0", "s0")
        assert tree(c) == {"s0": ("", 2), "a0": ("s0", 1), "b0": ("s0", 1)}
    assert "object 'a0' on tier ssd: its new context 'a0' is not written there" in daemon.logs()


def _hits(client: KVClient) -> dict[str, int]:
    return {c.context_id: c.hits for c in client.contexts()}


def test_a_split_child_starts_its_own_hit_count(client):
    """Issue 41: a child split off a context counted the context's reads as its own (2 hits
    after one read). Reads before the split are the context's; each part counts its own after."""
    put_prompt(client, ["s0", "s1", "a0", "a1"])
    client.get("s0")
    assert _hits(client) == {"s0": 1}
    put_prompt(client, ["b0"], after="s1")  # splits a0, a1 off s0
    assert _hits(client) == {"s0": 1, "a0": 0, "b0": 0}
    client.get("a0")
    assert _hits(client) == {"s0": 1, "a0": 1, "b0": 0}
