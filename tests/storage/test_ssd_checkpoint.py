"""Issue 42.4 and 42.5 on real files: ``SsdTier.put_many`` (many objects, one sync) and the
index checkpoint a restart reads instead of every header, with the header scan as its fallback
when the checkpoint is missing, torn, stale or disagrees with the files."""

from __future__ import annotations

import os
import shutil
import struct
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from kvtierd.config import TierConfig
from kvtierd.errors import AlreadyExistsError
from kvtierd.storage import ssd, ssd_checkpoint
from kvtierd.storage.ssd import SsdTier
from kvtierd.storage.ssd_checkpoint import (
    checkpoint_path,
    stamp_dirs,
    stamp_files,
    write_checkpoint,
)
from kvtierd.types import ObjectMeta

N = 40
SIZE = 4096 + 100


def _tier(path: Path, **options: Any) -> SsdTier:
    return SsdTier(TierConfig("ssd", "ssd", 1 << 30, str(path), dict(options)))


def _data(i: int) -> bytes:
    return np.random.default_rng(i).bytes(SIZE)


async def _filled(path: Path, n: int = N) -> set[str]:
    """A tier at ``path`` given ``n`` objects in one batch, then stopped (checkpoint written)."""
    t = _tier(path)
    await t.start()
    items = [(ObjectMeta(key=f"k{i}", size_bytes=SIZE), memoryview(_data(i))) for i in range(n)]
    stored = await t.put_many(items)
    assert all(m.checksum for m in stored)
    await t.close()
    return {f"k{i}" for i in range(n)}


async def _restarted(path: Path) -> tuple[SsdTier, dict[str, bytes]]:
    t = _tier(path)
    await t.start()
    found = {}
    for m in t.metas():
        buf = bytearray(m.size_bytes)
        await t.read_into(m.key, memoryview(buf))
        found[m.key] = bytes(buf)
    return t, found


def _intact(found: dict[str, bytes], keys: set[str]) -> bool:
    return set(found) == keys and all(found[k] == _data(int(k[1:])) for k in keys)


async def _restarts_whole(path: Path, keys: set[str], source: str) -> None:
    """A restart at ``path`` finds ``keys`` as put, its index found as ``source`` says."""
    t, found = await _restarted(path)
    try:
        assert _intact(found, keys)
        assert t.index_source.startswith(source), t.index_source
    finally:
        await t.close()


async def test_a_batch_is_stored_whole_and_a_valid_checkpoint_is_used_at_restart(tmp_path):
    keys = await _filled(tmp_path / "ssd")
    assert checkpoint_path(_tier(tmp_path / "ssd").layout).exists()
    t, found = await _restarted(tmp_path / "ssd")
    try:
        assert _intact(found, keys)
        assert t.index_source.startswith(f"index checkpoint: {N} objects from it, 0 headers read")
    finally:
        await t.close()


async def test_a_batch_naming_an_existing_key_stores_nothing(tmp_path):
    t = _tier(tmp_path / "ssd")
    await t.start()
    try:
        await t.put_many([(ObjectMeta(key="a", size_bytes=SIZE), memoryview(_data(0)))])
        again = [(ObjectMeta(key=k, size_bytes=SIZE), memoryview(_data(1))) for k in ("b", "a")]
        with pytest.raises(AlreadyExistsError):
            await t.put_many(again)
        assert [m.key for m in t.metas()] == ["a"]
    finally:
        await t.close()


@pytest.mark.parametrize("damage", ["missing", "torn"])
async def test_a_missing_or_torn_checkpoint_falls_back_to_the_header_scan(tmp_path, damage):
    keys = await _filled(tmp_path / "ssd")
    ckpt = checkpoint_path(_tier(tmp_path / "ssd").layout)
    if damage == "missing":
        ckpt.unlink()
    else:  # cut short, as a crash in the middle of its write would leave a non-atomic copy
        ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    t, found = await _restarted(tmp_path / "ssd")
    try:
        assert _intact(found, keys)
        assert t.index_source.startswith(f"header scan of {N} files (index checkpoint {damage}")
    finally:
        await t.close()


async def test_a_stale_checkpoint_is_used_only_for_the_files_it_knows_as_they_are(tmp_path):
    path = tmp_path / "ssd"
    keys = await _filled(path)
    old = tmp_path / "old.ckpt"
    shutil.copy(checkpoint_path(_tier(path).layout), old)
    t = _tier(path)
    await t.start()
    new = [(ObjectMeta(key=f"k{i}", size_bytes=SIZE), memoryview(_data(i))) for i in (100, 101)]
    await t.put_many(new)
    await t.delete("k0")
    await t.delete("k1")
    await t.delete("k2")
    await t.close()
    shutil.copy(old, checkpoint_path(t.layout))  # as if killed after those changes
    t, found = await _restarted(path)
    try:
        assert _intact(found, (keys - {"k0", "k1", "k2"}) | {"k100", "k101"})
        assert t.index_source.startswith(
            f"index checkpoint: {N - 3} objects from it, 2 headers read "
            "(files new or changed since it), 3 of its files gone"
        )
    finally:
        await t.close()


async def test_a_checkpoint_that_disagrees_with_a_file_header_is_discarded(tmp_path):
    path = tmp_path / "ssd"
    keys = await _filled(path)
    t = _tier(path)
    await t.start()
    files = [t._file(m) for m in t._index.values()]
    await t.close()
    # a row whose file stamp still matches but whose metadata is not the header's
    files[0] = files[0]._replace(meta=files[0].meta.replace(checksum=1))
    write_checkpoint(t.layout, stamp_dirs(t.layout), stamp_files(files, t.layout), sync=False)
    t, found = await _restarted(path)
    try:
        assert _intact(found, keys)
        assert t.index_source.startswith(f"header scan of {N} files (index checkpoint disagrees")
    finally:
        await t.close()


async def test_rows_whose_fields_do_not_check_have_their_headers_read(tmp_path):
    path = tmp_path / "ssd"
    keys = await _filled(path)
    t = _tier(path)
    await t.start()
    files = [t._file(m) for m in sorted(t._index.values(), key=lambda m: m.key)]
    await t.close()
    # a kind no header could hold (a shape of strings), a position past the largest, a header
    # length that is not whole pages, one longer than the file, data that ends past the file
    files[0] = files[0]._replace(meta=files[0].meta.replace(shape=("x",)))
    files[1] = files[1]._replace(meta=files[1].meta.replace(position=-5))
    files[2] = files[2]._replace(meta=files[2].meta.replace(size_bytes=1), header_len=4096 + 100)
    files[3] = files[3]._replace(meta=files[3].meta.replace(size_bytes=0), header_len=4096 * 1000)
    files[4] = files[4]._replace(meta=files[4].meta.replace(size_bytes=1 << 40))
    write_checkpoint(t.layout, stamp_dirs(t.layout), stamp_files(files, t.layout), sync=False)
    await _restarts_whole(path, keys, f"index checkpoint: {N - 5} objects from it, 5 headers read")


async def test_a_checkpoint_with_bytes_after_its_last_field_is_not_used(tmp_path):
    keys = await _filled(tmp_path / "ssd")
    ckpt = checkpoint_path(_tier(tmp_path / "ssd").layout)
    head = struct.Struct("<8sIQQ")  # magic, version, body length, xxh3_64 of the body
    raw = ckpt.read_bytes()
    magic, version, _, _ = head.unpack_from(raw)
    body = raw[head.size :] + b"\x00"  # checksummed as written: only the parse can tell
    ckpt.write_bytes(head.pack(magic, version, len(body), xxhash.xxh3_64_intdigest(body)) + body)
    await _restarts_whole(
        tmp_path / "ssd",
        keys,
        f"header scan of {N} files (index checkpoint malformed (1 bytes after the last field)",
    )


async def test_a_directory_unchanged_since_the_checkpoint_vouches_for_its_files(tmp_path):
    """A fan-out directory whose mtime is the one recorded is taken without a stat a file: a
    file touched in place there is taken from its row; one in a directory a file was put into
    since is checked file by file, and its header read."""
    path = tmp_path / "ssd"
    keys = await _filled(path)
    layout = _tier(path).layout
    past = time.time_ns() - 60 * 10**9  # older than the racy margin: the checkpoint vouches
    for d in layout.subdirs():
        os.utime(d, ns=(past, past))
    t = _tier(path)
    await t.start()
    await t.close()  # its checkpoint records every directory's mtime
    saved = tmp_path / "saved.ckpt"
    shutil.copy(checkpoint_path(layout), saved)
    dir_of = {k: Path(layout.object_path("", k)).parent for k in keys}
    new = next(f"n{i}" for i in range(10_000) if Path(layout.object_path("", f"n{i}")).parent
               == dir_of["k0"])  # fmt: skip
    other = next(k for k in sorted(keys) if dir_of[k] != dir_of["k0"])
    for k in ("k0", other):  # in place: their stamps change, their directories' do not
        os.utime(layout.object_path("", k), ns=(past, past))
    t = _tier(path)
    await t.start()
    await t.put(ObjectMeta(key=new, size_bytes=SIZE), memoryview(_data(0)))
    await t.close()
    shutil.copy(saved, checkpoint_path(layout))  # as if killed after the put
    t, found = await _restarted(path)
    try:
        assert set(found) == keys | {new}
        assert t.index_source.startswith(
            f"index checkpoint: {N - 1} objects from it, 2 headers read"
        )  # k0 (its directory changed, its stamp too) and the new file; not the other
    finally:
        await t.close()


async def test_a_contexts_chunks_share_one_context_id_string_after_a_restart(tmp_path):
    """Issue 42's metadata memory: a context id read from the checkpoint is one string for
    every chunk naming it (and for its children's parent), not one copy an object."""
    path = tmp_path / "ssd"
    t = _tier(path)
    await t.start()
    items = [(ObjectMeta(key=f"p{i}", size_bytes=SIZE, context_id="prompt", position=i),
              memoryview(_data(i))) for i in range(3)]  # fmt: skip
    items.append((ObjectMeta(key="c0", size_bytes=SIZE, context_id="branch",
                             parent_context_id="prompt"), memoryview(_data(3))))  # fmt: skip
    await t.put_many(items)
    await t.close()
    t, found = await _restarted(path)
    try:
        assert len(found) == 4
        named = [m.context_id for m in t.metas() if m.context_id == "prompt"]
        named += [m.parent_context_id for m in t.metas() if m.parent_context_id]
        assert len(named) == 4 and len({id(s) for s in named}) == 1
    finally:
        await t.close()


def test_a_directory_just_changed_is_waited_for_and_one_stamped_in_the_future_is_not(
    tmp_path, monkeypatch
):
    waits: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:  # recorded; a wrong hour-long wait fails, not hangs
        waits.append(seconds)
        real_sleep(min(seconds, 0.2))

    monkeypatch.setattr(ssd_checkpoint.time, "sleep", sleep)
    layout = _tier(tmp_path / "ssd").layout
    layout.create()
    dirs = layout.subdirs()
    (dirs[0] / "x").write_bytes(b"")  # changed now: within the margin, waited for
    ahead = time.time_ns() + 3600 * 10**9  # a clock stepped back: not vouched for, no wait
    os.utime(dirs[1], ns=(ahead, ahead))
    stamps = stamp_dirs(layout)
    assert len(waits) == 1 and 0 < waits[0] <= ssd_checkpoint.RACY_NS / 1e9  # not the hour ahead
    assert stamps[0] == os.stat(dirs[0]).st_mtime_ns
    assert stamps[1] == -1
    assert stamps[2] == os.stat(dirs[2]).st_mtime_ns


async def test_stamping_files_for_a_checkpoint_keeps_columns_not_an_object_a_file(tmp_path):
    """A checkpoint is written every ``index_checkpoint_s`` while puts go on. Its stamps were a
    tuple of a stat, a digest and a file per object (~370 bytes, ~800 with the encoding's
    lists), which the allocator kept among the objects put meanwhile (issue 42: a daemon that
    took 300k puts with a checkpoint every 20 s grew 1,892 bytes an object, 1,027 without
    checkpoints). Now columns: a digest, an object reference and four numbers a file."""
    path = tmp_path / "ssd"
    await _filled(path, 400)
    t = _tier(path)
    await t.start()
    try:
        files = [(m, 4096) for m in t._index.values()]
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            stamped = stamp_files(files, t.layout)
            per_file = (tracemalloc.get_traced_memory()[0] - before) / len(files)
        finally:
            tracemalloc.stop()
        assert len(stamped) == 400 and len(stamped.digests) == 400 * 16
        assert per_file < 80, per_file  # 16 + 8 + 4 + 3 x 8 bytes, and the arrays' slack
        await t.close()  # writes the checkpoint from those columns: read back whole
        await _restarts_whole(path, {f"k{i}" for i in range(400)},
                              "index checkpoint: 400 objects from it")  # fmt: skip
    finally:
        await t.close()


async def test_a_checkpoint_hands_its_freed_heap_back(tmp_path, monkeypatch):
    """Its columns and body (tens of MB at 1M objects) are freed into a heap the daemon never
    trims otherwise (kvtierd/heap.py): each checkpoint trims it once written, off the loop."""
    trimmed: list[str] = []
    monkeypatch.setattr(ssd, "trim", lambda why: trimmed.append(why) or True)
    path = tmp_path / "ssd"
    await _filled(path, 3)
    assert trimmed == ["an index checkpoint"]  # the stop's checkpoint
