"""A restarted daemon lists each context's chunks in the order they were put (issue 31), from
the SSD tier's files and from the remote store's headers: the segment rule's "last chunk"
(engine/tree_joins.py), the KV the profiler reads and the first tokens a token-dropped variant
keeps all follow that order. The tiers list objects in scan order (file hashes, Redis SCAN),
so the order is kept as each chunk's position in its persistent copy's header."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import yaml

from kvtierd.client import KVClient
from kvtierd.errors import CorruptObjectError
from kvtierd.rpc import kvtier_pb2 as pb
from kvtierd.storage.remote_format import ObjectHeader, object_keys
from kvtierd.storage.ssd_format import decode_header, encode_header
from kvtierd.types import ObjectMeta

CHUNK = np.ones(4096, np.uint8)
# 16 chunks named so that neither key order nor any hash order is the order they are put.
PROMPT = [f"chunk-{(i * 7) % 16:02d}" for i in range(16)]
STORES = ["ssd", pytest.param("remote", marks=pytest.mark.redis)]


def put_prompt(c: KVClient, keys: list[str], after: str = "") -> pb.WriteAdvice:
    """What the LMCache plugin does for one put (tests/daemon/test_context_tree.py)."""
    advice = c.advise(keys[0], len(keys) * 256, len(keys) * CHUNK.size, after_key=after)
    for key in keys:
        c.put(key, CHUNK, context_id=advice.context_id,
              parent_context_id=advice.parent_context_id)  # fmt: skip
    return advice


def chunks(c: KVClient, context_id: str) -> list[str]:
    """The context's objects as the daemon lists them (its index order)."""
    got = c.call(c.admin.DescribeContext, pb.DescribeContextRequest(context_id=context_id))
    return [o.spec.key for o in got.objects]


def tree(c: KVClient) -> dict[str, tuple[str, int]]:
    """context -> (parent, objects)."""
    return {x.context_id: (x.parent_context_id, x.objects) for x in c.contexts()}


def _settle(c: KVClient) -> None:
    deadline = time.monotonic() + 10
    while c.status().pending_plans and time.monotonic() < deadline:
        time.sleep(0.01)


def _daemon(start_daemon, request, store: str):
    """A daemon whose objects are all in ``store`` once :func:`_store_down` ran."""
    if store == "ssd":
        return start_daemon(cpu="16MiB", ssd="64MiB")
    cluster = request.getfixturevalue("redis_cluster")
    remote = {
        "name": "remote", "kind": "remote", "capacity": 0,
        "options": {"nodes": cluster.addresses, "namespace": f"order-{uuid.uuid4().hex[:12]}",
                    "value_bytes": 1 << 20},
    }  # fmt: skip
    return start_daemon(cpu="16MiB", ssd="64MiB", extra_tiers=[remote])


def _store_down(c: KVClient, store: str) -> None:
    """Move every object down to ``store``: what a restart finds is only its copies."""
    for tier in ("cpu", "ssd")[: 1 if store == "ssd" else 2]:
        c.drain(tier)
        _settle(c)
    assert {s.tier for s in c.contexts()} == {store}


def _restart(daemon) -> None:
    assert daemon.stop() == 0
    daemon.start()


@pytest.mark.parametrize("store", STORES)
def test_a_context_comes_back_in_put_order(start_daemon, request, store):
    """16 chunks put in two puts (chunked prefill) come back in that order, and a put after
    the last one still extends the context (the segment rule's last-chunk check)."""
    daemon = _daemon(start_daemon, request, store)
    with KVClient(daemon.socket_path, timeout_s=20) as c:
        put_prompt(c, PROMPT[:8])
        put_prompt(c, PROMPT[8:], after=PROMPT[7])
        assert chunks(c, PROMPT[0]) == PROMPT
        _store_down(c, store)
    _restart(daemon)
    with KVClient(daemon.socket_path, timeout_s=20) as c:
        assert chunks(c, PROMPT[0]) == PROMPT
        joins = put_prompt(c, ["next"], after=PROMPT[-1])
        assert (joins.context_id, joins.parent_context_id) == (PROMPT[0], "")
        assert tree(c) == {PROMPT[0]: ("", 17)}
        assert chunks(c, PROMPT[0]) == [*PROMPT, "next"]
        _store_down(c, store)
    _restart(daemon)  # the chunk put after a restart is numbered after those found
    with KVClient(daemon.socket_path, timeout_s=20) as c:
        assert chunks(c, PROMPT[0]) == [*PROMPT, "next"]


@pytest.mark.parametrize("store", STORES)
def test_a_split_tree_comes_back_with_each_segment_in_order(start_daemon, request, store):
    """A branch inside a context splits it (engine/tree_joins.py): the prefix keeps its first
    chunks, the child the later ones, each in its own order after a restart; the child's
    positions are those it had in the prefix, and order it all the same."""
    prefix, doc = PROMPT[:8], PROMPT[8:]
    daemon = _daemon(start_daemon, request, store)
    with KVClient(daemon.socket_path, timeout_s=20) as c:
        put_prompt(c, [*prefix, *doc])
        put_prompt(c, ["b1", "b0", "b2"], after=prefix[-1])
        before = tree(c)
        assert before == {prefix[0]: ("", 8), doc[0]: (prefix[0], 8), "b1": (prefix[0], 3)}
        _store_down(c, store)
    _restart(daemon)
    with KVClient(daemon.socket_path, timeout_s=20) as c:
        assert tree(c) == before
        assert chunks(c, prefix[0]) == prefix
        assert chunks(c, doc[0]) == doc
        assert chunks(c, "b1") == ["b1", "b0", "b2"]
        # the child's last chunk is its last again: a put after it extends the child
        joins = put_prompt(c, ["more"], after=doc[-1])
        assert (joins.context_id, joins.parent_context_id) == (doc[0], prefix[0])


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


def _without_position(meta: ObjectMeta) -> ObjectMeta:
    """``meta`` as a build before issue 31 wrote it (its header has no position)."""
    return meta.replace(position=None)


def test_files_written_before_positions_load_in_key_order(start_daemon, request):
    """Files without a position (an earlier build) load, in key order (docs/integration.md):
    deterministic, not the order they were put. A chunk put after the restart is numbered, so
    it comes after all of them at the next restart (a numbered chunk was put after every
    chunk without a number)."""
    daemon = _daemon(start_daemon, request, "ssd")
    with KVClient(daemon.socket_path, timeout_s=20) as c:
        put_prompt(c, PROMPT)
        _store_down(c, "ssd")
    assert daemon.stop() == 0
    for path, meta in _files(daemon).values():
        _rewrite(path, _without_position(meta))
    daemon.start()
    with KVClient(daemon.socket_path, timeout_s=20) as c:
        assert chunks(c, PROMPT[0]) == sorted(PROMPT)
        assert tree(c) == {PROMPT[0]: ("", 16)}
        put_prompt(c, ["zz-new"], after=sorted(PROMPT)[-1])
        _store_down(c, "ssd")
    _restart(daemon)
    with KVClient(daemon.socket_path, timeout_s=20) as c:
        assert chunks(c, PROMPT[0]) == [*sorted(PROMPT), "zz-new"]
    assert "Traceback" not in daemon.logs()


HOSTILE = {  # chunk -> the position its header is given, and what the log names
    PROMPT[1]: (-1, "position -1 is not an integer in [0, 2147483647]"),
    PROMPT[2]: ("3", "position is str, not an integer"),
    PROMPT[3]: (True, "position is bool, not an integer"),
    PROMPT[4]: (1 << 40, f"position {1 << 40} is not an integer in [0, 2147483647]"),
    PROMPT[5]: (2.5, "position is float, not an integer"),
}


def test_hostile_positions_are_refused_by_name(start_daemon, request):
    """A position read back from the disk is checked: not an integer, negative, huge, or one
    claimed by two chunks of a context is refused (the file quarantined, the reason logged
    with the field and what is allowed), and the rest of the context loads in order."""
    daemon = _daemon(start_daemon, request, "ssd")
    with KVClient(daemon.socket_path, timeout_s=20) as c:
        put_prompt(c, PROMPT)
        _store_down(c, "ssd")
    assert daemon.stop() == 0
    files = _files(daemon)
    for key, (position, _) in HOSTILE.items():
        path, meta = files[key]
        _rewrite(path, meta.replace(position=position))  # type: ignore[arg-type]
    for key in PROMPT[6:8]:  # both claim position 6
        path, meta = files[key]
        _rewrite(path, meta.replace(position=6))
    daemon.start()
    refused = {*HOSTILE, *PROMPT[6:8]}
    with KVClient(daemon.socket_path, timeout_s=20) as c:
        assert chunks(c, PROMPT[0]) == [k for k in PROMPT if k not in refused]
    logs = daemon.logs()
    for _, named in HOSTILE.values():
        assert named in logs
    assert logs.count(f"position 6 of context {PROMPT[0]!r} is claimed by 2 objects") == 2
    assert "Traceback" not in logs
    quarantine = Path(daemon.config).parent / "ssd" / "quarantine"
    assert len(list(quarantine.iterdir())) == len(refused)


@pytest.mark.parametrize(("position", "named"), list(HOSTILE.values()))
def test_a_remote_header_with_a_hostile_position_is_unreadable(position, named):
    """The remote header's position is checked as the SSD header's is: a header refused is
    skipped by the start-up scan and deleted by its next reader (docs/remote-tier.md)."""
    meta = ObjectMeta(key="k", size_bytes=1, context_id="c", position=position)
    raw = ObjectHeader(meta, part_bytes=1, parts=1, generation="0" * 16).encode()
    with pytest.raises(CorruptObjectError, match=named.replace("[", r"\[")):
        ObjectHeader.decode(raw)
    ok = ObjectHeader(meta.replace(position=7), part_bytes=1, parts=1, generation="0" * 16)
    assert ObjectHeader.decode(ok.encode()).meta.position == 7


@pytest.mark.redis
def test_hostile_remote_positions_are_refused_by_name(start_daemon, request, raw_redis):
    """A remote header with a position that is not allowed is skipped at start, named in the
    log (its next reader deletes it, as any unreadable header); two headers of a context at
    one position are both refused; the rest of the context loads in order."""
    daemon = _daemon(start_daemon, request, "remote")
    with KVClient(daemon.socket_path, timeout_s=20) as c:
        put_prompt(c, PROMPT)
        _store_down(c, "remote")
    assert daemon.stop() == 0
    namespace = next(t["options"]["namespace"] for t in _tiers(daemon) if t["kind"] == "remote")
    given = {PROMPT[1]: -1, PROMPT[2]: "3", PROMPT[6]: 6, PROMPT[7]: 6}
    for key, position in given.items():
        name = object_keys(namespace, "", key).header
        doc = json.loads(raw_redis.get(name))
        doc["position"] = position
        raw_redis.set(name, json.dumps(doc).encode())
    daemon.start()
    with KVClient(daemon.socket_path, timeout_s=20) as c:
        assert chunks(c, PROMPT[0]) == [k for k in PROMPT if k not in given]
    logs = daemon.logs()
    assert "position -1 is not an integer in [0, 2147483647]" in logs
    assert "position is str, not an integer" in logs
    assert logs.count(f"position 6 of context {PROMPT[0]!r} is claimed by 2 objects") == 2
    assert "Traceback" not in logs


def _tiers(daemon) -> list[dict]:
    return list(yaml.safe_load(Path(daemon.config).read_text())["tiers"])
