"""SsdTier on real files (tmp_path is ext4 here, so O_DIRECT is exercised for real)."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import mmap
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtierd.config import TierConfig
from kvtierd.errors import (
    AlreadyExistsError,
    ConfigError,
    CorruptObjectError,
    InvalidArgumentError,
    NotFoundError,
    StorageFullError,
    UnavailableError,
)
from kvtierd.storage import aligned_io, ssd_probe
from kvtierd.storage import ssd as ssd_module
from kvtierd.storage.base import TransferMeter, create_tier
from kvtierd.storage.ssd import SsdTier
from kvtierd.storage.ssd_format import decode_header, encode_header, meta_from_doc
from kvtierd.types import ObjectMeta

MiB = 1 << 20


def make_tier(path: Path, **options: Any) -> SsdTier:
    return SsdTier(TierConfig("ssd", "ssd", 1 << 30, str(path), dict(options)))


@pytest.fixture
async def tier(tmp_path: Path) -> AsyncIterator[SsdTier]:
    t = make_tier(tmp_path / "ssd", part_bytes="1MiB")
    await t.start()
    yield t
    await t.close()


def payload(size: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).bytes(size)


def aligned(size: int) -> memoryview:
    """A page-aligned writable view of ``size`` bytes (like an arena region)."""
    return memoryview(mmap.mmap(-1, max(size, 1)))[:size]


def meta(key: str, size: int, **kw: Any) -> ObjectMeta:
    return ObjectMeta(key=key, size_bytes=size, **kw)


async def round_trip(
    tier: SsdTier, key: str, data: bytes, src: memoryview, dst: memoryview
) -> None:
    src[:] = data
    stored = await tier.put(meta(key, len(data)), src)
    assert stored.checksum != 0
    got = await tier.read_into(key, dst)
    assert got == stored
    assert bytes(dst[: len(data)]) == data


# -- round trips ------------------------------------------------------------------------------

SIZES = [0, 1, 4095, 4096, 4097, 3 * MiB + 5, 64 * MiB]


@pytest.mark.parametrize("o_direct", ["auto", False])
@pytest.mark.parametrize("size", SIZES)
async def test_round_trip_aligned_views(tmp_path: Path, size: int, o_direct: str | bool) -> None:
    t = make_tier(tmp_path, o_direct=o_direct)
    await t.start()
    assert t.direct is (o_direct == "auto")
    await round_trip(t, "k", payload(size, size), aligned(size), aligned(size))
    assert t.used_bytes() == size and t.object_count() == 1
    await t.close()


@pytest.mark.parametrize("size", [1, 4097, 3 * MiB + 5])
async def test_round_trip_unaligned_views(tier: SsdTier, size: int) -> None:
    src, dst = bytearray(size + 1), bytearray(size + 3)
    await round_trip(tier, "k", payload(size), memoryview(src)[1:], memoryview(dst)[3:])


async def test_read_does_not_write_past_size(tier: SsdTier) -> None:
    """An aligned destination longer than the object keeps its bytes after ``size_bytes``
    (the padded last page is staged, not read straight into the caller's memory)."""
    size = 2 * MiB + 100
    await tier.put(meta("k", size), memoryview(payload(size)))
    dst = aligned(size + 8192)
    dst[size:] = b"\xab" * 8192
    await tier.read_into("k", dst)
    assert bytes(dst[size:]) == b"\xab" * 8192


async def test_put_accepts_typed_and_readonly_buffers(tier: SsdTier) -> None:
    arr = np.arange(1000, dtype=np.float16).reshape(10, 100)
    await tier.put(meta("arr", arr.nbytes, dtype="float16", shape=(10, 100)), memoryview(arr))
    out = np.empty_like(arr)
    got = await tier.read_into("arr", memoryview(out))
    assert np.array_equal(out, arr) and got.shape == (10, 100) and got.dtype == "float16"
    with pytest.raises(InvalidArgumentError, match="read-only"):
        await tier.read_into("arr", memoryview(bytes(arr.nbytes)))
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        await tier.put(meta("t", 1000), memoryview(arr[:, ::2]))


async def test_bad_sizes_and_checksums(tier: SsdTier) -> None:
    with pytest.raises(InvalidArgumentError, match="size_bytes"):
        await tier.put(meta("k", 10), memoryview(bytes(9)))
    data = payload(5000)
    with pytest.raises(InvalidArgumentError, match="checksum"):
        await tier.put(meta("k", 5000, checksum=123), memoryview(data))
    assert not tier.contains("k") and not list((tier.layout.tmp).iterdir())
    good = await tier.put(meta("k", 5000), memoryview(data))
    await tier.delete("k")
    assert await tier.put(meta("k", 5000, checksum=good.checksum), memoryview(data)) == good
    with pytest.raises(InvalidArgumentError, match="destination holds"):
        await tier.read_into("k", memoryview(bytearray(4999)))


async def test_file_names_hide_client_strings(tier: SsdTier) -> None:
    await tier.put(meta("../../evil", 3, tenant="t/../x"), memoryview(b"abc"))
    files = [p for p in tier.layout.root.rglob("*") if p.is_file()]
    assert len(files) == 1 and files[0].parent.parent == tier.layout.objects
    assert "evil" not in str(files[0]) and len(files[0].stem) == 32


# -- restart and crash leftovers --------------------------------------------------------------


async def test_restart_rebuilds_index_from_headers(tmp_path: Path) -> None:
    kept = np.arange(3000, dtype="<i4").tobytes()  # 12 KB: a multi-page header
    metas = [
        meta("a", 4097, context_id="ctx", variant="knorm@0.5", layout="KV_2LTD", tenant="t1"),
        meta("b", 0, token_count=7, kept_indices=kept, shape=(2, 3)),
        meta("c", 2 * MiB, dtype="bfloat16"),
    ]
    t = make_tier(tmp_path)
    await t.start()
    stored = [await t.put(m, memoryview(payload(m.size_bytes, i))) for i, m in enumerate(metas)]
    for i, m in enumerate(metas):  # before the restart too: the multi-page header's offset
        dst = bytearray(m.size_bytes)
        assert await t.read_into(m.key, memoryview(dst)) == stored[i]
        assert bytes(dst) == payload(m.size_bytes, i)
    await t.close()
    (tmp_path / "tmp" / "crashed.tmp").write_bytes(b"half an object")
    t2 = make_tier(tmp_path)
    await t2.start()
    assert sorted(t2.metas(), key=lambda m: m.key) == stored
    assert t2.used_bytes() == sum(m.size_bytes for m in metas)
    assert list((tmp_path / "tmp").iterdir()) == [] and t2.quarantined_count == 0
    for i, m in enumerate(metas):
        dst = bytearray(m.size_bytes)
        assert await t2.read_into(m.key, memoryview(dst)) == stored[i]
        assert bytes(dst) == payload(m.size_bytes, i)
    await t2.close()


def test_header_round_trip_and_damage() -> None:
    kept = b"\x01\x00\x00\x00" * 3000
    m = meta("k", 10, kept_indices=kept, checksum=2**64 - 1, shape=(1,))
    raw = encode_header(m)
    assert len(raw) == 12288 and decode_header(raw, "x").meta == m
    for at in (0, 9, 14, 24, 40, len(raw) - 4096 - 100):  # magic, version, lengths, sum, ...
        bad = bytearray(raw)
        bad[at] ^= 0x40
        with pytest.raises(CorruptObjectError, match="x: "):
            decode_header(bytes(bad), "x")


def test_a_childs_parent_survives_in_the_ssd_and_remote_headers() -> None:
    """Issue 29: a child context's objects carry their parent, so a restart that reads the
    objects back rebuilds the tree; other objects' headers stay as earlier versions wrote."""
    from kvtierd.storage.remote_format import ObjectHeader

    child = meta("k", 10, parent_context_id="system-prompt")
    assert decode_header(encode_header(child), "x").meta == child
    plain = meta("k", 10)
    assert b"parent_context_id" not in encode_header(plain)
    remote = ObjectHeader(child, part_bytes=10, parts=1, generation="g")
    assert ObjectHeader.decode(remote.encode()).meta == child
    assert b"parent_context_id" not in ObjectHeader(plain, 10, 1, "g").encode()


async def test_relabel_rewrites_the_header_and_survives_a_restart(tmp_path: Path) -> None:
    """Issue 29: a context split at a branch gives its later chunks a new context; the file's
    header says so (its data and checksum unchanged), also after a restart."""
    size = 3 * MiB + 17
    t = make_tier(tmp_path, part_bytes="1MiB")
    await t.start()
    stored = await t.put(meta("k", size, context_id="prompt"), memoryview(payload(size)))
    await t.relabel(stored.replace(context_id="k", parent_context_id="prompt", variant="x"))
    moved = stored.replace(context_id="k", parent_context_id="prompt")  # identity only
    assert t.get_meta("k") == moved
    dst = bytearray(size)
    assert await t.read_into("k", memoryview(dst)) == moved
    assert bytes(dst) == payload(size)
    with pytest.raises(NotFoundError, match="'gone' not found"):
        await t.relabel(meta("gone", 1))
    await t.close()
    assert list((tmp_path / "tmp").iterdir()) == []
    t2 = make_tier(tmp_path)
    await t2.start()
    assert list(t2.metas()) == [moved] and t2.quarantined_count == 0
    assert await t2.read_into("k", memoryview(dst)) == moved and bytes(dst) == payload(size)
    await t2.close()


def test_old_headers_without_a_parent_load_as_roots() -> None:
    """Files written before issue 29 have no ``parent_context_id``: their objects are roots."""
    import json

    from kvtierd.storage.ssd_format import PREFIX_BYTES

    raw = encode_header(meta("k", 10, context_id="c"))
    doc = json.loads(raw[PREFIX_BYTES : raw.index(b"}") + 1])
    assert "parent_context_id" not in doc and doc["context_id"] == "c"  # as old files are
    assert decode_header(raw, "x").meta.parent_context_id == ""


@pytest.mark.parametrize(
    ("parent", "context_id", "message"),
    [
        (7, "c", "parent_context_id is int, not a string"),
        ("a\x00b", "c", "parent_context_id must be a context id of at most 1024 bytes"),
        ("p" * 1025, "c", "parent_context_id must be a context id of at most 1024 bytes"),
        ("c", "c", "parent_context_id 'c' is the object's own context"),
        ("k", "", "parent_context_id 'k' is the object's own context"),
    ],
)
def test_hostile_parents_in_headers_are_refused_by_name(
    parent: object, context_id: str, message: str
) -> None:
    """A header is read back from a disk or a shared store: a parent link no put could have
    made is corruption, named with what is allowed, never a traceback or a cycle."""
    from kvtierd.storage.remote_format import ObjectHeader

    bad = ObjectMeta(key="k", size_bytes=10, context_id=context_id, parent_context_id=parent)  # type: ignore[arg-type]
    with pytest.raises(
        CorruptObjectError, match=f"x: malformed header metadata: {re.escape(message)}"
    ):
        decode_header(encode_header(bad), "x")
    with pytest.raises(CorruptObjectError, match=f"unreadable header: {re.escape(message)}"):
        ObjectHeader.decode(ObjectHeader(bad, 10, 1, "g").encode())


async def test_a_hostile_parent_is_quarantined_at_start(tmp_path: Path) -> None:
    t = make_tier(tmp_path)
    await t.start()
    await t.put(meta("ok", 3), memoryview(b"abc"))
    await t.close()
    bad = ObjectMeta(key="k", size_bytes=3, context_id="k", parent_context_id="k")
    path = t.layout.object_path("", "k")
    Path(path).write_bytes(encode_header(bad) + b"abc")  # a header a put never writes
    t2 = make_tier(tmp_path)
    await t2.start()
    assert [m.key for m in t2.metas()] == ["ok"]
    await assert_quarantined(t2, "k")
    await t2.close()


# -- corruption -------------------------------------------------------------------------------


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


async def assert_quarantined(tier: SsdTier, key: str, count: int = 1) -> None:
    assert tier.quarantined_count == count
    assert not tier.contains(key)
    with pytest.raises(NotFoundError):
        await tier.read_into(key, memoryview(bytearray(8 * MiB)))
    assert len(list(tier.layout.quarantine.iterdir())) == count


@pytest.mark.parametrize("o_direct", ["auto", False])
@pytest.mark.parametrize("where", ["data_first", "data_last", "header"])
async def test_corrupt_byte_is_quarantined(tmp_path: Path, where: str, o_direct: str) -> None:
    t = make_tier(tmp_path, o_direct=o_direct)
    await t.start()
    size = 3 * MiB + 17
    await t.put(meta("k", size), memoryview(payload(size)))
    await t.put(meta("other", 10), memoryview(b"0123456789"))
    path = t.layout.object_path("", "k")
    flip(path, {"data_first": 4096, "data_last": 4096 + size - 1, "header": 60}[where])
    with pytest.raises(CorruptObjectError, match="quarantined"):
        await t.read_into("k", memoryview(bytearray(size)))
    await assert_quarantined(t, "k")
    assert not os.path.exists(path)
    dst = bytearray(10)
    await t.read_into("other", memoryview(dst))  # the rest is still served
    assert dst == b"0123456789"
    await t.put(meta("k", 5), memoryview(b"fresh"))  # the key can be stored again
    await t.close()


async def test_truncated_file_is_quarantined_on_read(tier: SsdTier) -> None:
    size = 2 * MiB
    await tier.put(meta("k", size), memoryview(payload(size)))
    os.truncate(tier.layout.object_path("", "k"), 4096 + size - 5000)
    with pytest.raises(CorruptObjectError, match="truncated"):
        await tier.read_into("k", memoryview(bytearray(size)))
    await assert_quarantined(tier, "k")


@pytest.mark.parametrize("damage", ["header", "truncate", "rename"])
async def test_damaged_files_are_quarantined_at_start(tmp_path: Path, damage: str) -> None:
    t = make_tier(tmp_path)
    await t.start()
    await t.put(meta("k", MiB), memoryview(payload(MiB)))
    await t.put(meta("ok", 3), memoryview(b"abc"))
    await t.close()
    path = Path(t.layout.object_path("", "k"))
    if damage == "header":
        flip(str(path), 9)
    elif damage == "truncate":
        os.truncate(path, 4096 + MiB - 1)
    else:  # a valid file under a name that is not its key's hash
        path.rename(path.with_name("0" * 32 + ".kvt"))
    t2 = make_tier(tmp_path)
    await t2.start()
    assert [m.key for m in t2.metas()] == ["ok"]
    await assert_quarantined(t2, "k")
    await t2.close()


# -- disk full --------------------------------------------------------------------------------


async def test_enospc_fails_cleanly_and_reads_go_on(
    tier: SsdTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    await tier.put(meta("old", 5), memoryview(b"hello"))
    real = os.pwritev
    calls = 0

    def full_after_two(fd: int, bufs: Any, offset: int) -> int:
        nonlocal calls
        calls += 1
        if calls > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, bufs, offset)

    monkeypatch.setattr(aligned_io.os, "pwritev", full_after_two)
    with pytest.raises(StorageFullError, match="no space for 8388608 bytes of 'big'"):
        await tier.put(meta("big", 8 * MiB), memoryview(payload(8 * MiB)))
    assert not tier.contains("big") and list(tier.layout.tmp.iterdir()) == []
    dst = bytearray(5)
    await tier.read_into("old", memoryview(dst))
    assert dst == b"hello"
    monkeypatch.setattr(aligned_io.os, "pwritev", real)
    await tier.put(meta("big", 8 * MiB), memoryview(payload(8 * MiB)))


def test_real_file_size_limit_gives_storage_full(tmp_path: Path) -> None:
    """A real kernel refusal: RLIMIT_FSIZE makes write(2) fail with EFBIG past 2 MiB."""
    script = textwrap.dedent(f"""
        import asyncio, resource, signal
        from kvtierd.config import TierConfig
        from kvtierd.errors import StorageFullError
        from kvtierd.storage.ssd import SsdTier
        from kvtierd.types import ObjectMeta
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))
        async def main():
            t = SsdTier(TierConfig("ssd", "ssd", 1 << 30, {str(tmp_path)!r}, {{}}))
            await t.start()  # the calibration files may not fit: start must still succeed
            await t.put(ObjectMeta(key="small", size_bytes=1000), memoryview(bytes(1000)))
            try:
                await t.put(ObjectMeta(key="big", size_bytes=4 << 20), memoryview(bytes(4 << 20)))
            except StorageFullError as e:
                print("FULL", e)
            print("KEYS", sorted(m.key for m in t.metas()))
            await t.close()
        asyncio.run(main())
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "FULL tier ssd: no space for 4194304 bytes of 'big'" in out.stdout
    assert "KEYS ['small']" in out.stdout
    assert list((tmp_path / "tmp").iterdir()) == []


# -- concurrency ------------------------------------------------------------------------------


async def test_concurrent_puts_and_reads_of_different_keys(tier: SsdTier) -> None:
    sizes = [(i * 977_777) % (5 * MiB) + i for i in range(16)]
    await asyncio.gather(
        *(tier.put(meta(f"k{i}", n), memoryview(payload(n, i))) for i, n in enumerate(sizes))
    )
    dsts = [aligned(n) if i % 2 else memoryview(bytearray(n)) for i, n in enumerate(sizes)]
    await asyncio.gather(*(tier.read_into(f"k{i}", d) for i, d in enumerate(dsts)))
    for i, n in enumerate(sizes):
        assert bytes(dsts[i]) == payload(n, i)
    assert tier.used_bytes() == sum(sizes) and tier.object_count() == 16


async def test_second_put_of_a_key_is_refused(tier: SsdTier) -> None:
    data = memoryview(payload(2 * MiB))
    results = await asyncio.gather(
        *(tier.put(meta("k", 2 * MiB), data) for _ in range(5)), return_exceptions=True
    )
    assert sum(isinstance(r, ObjectMeta) for r in results) == 1
    assert sum(isinstance(r, AlreadyExistsError) for r in results) == 4
    with pytest.raises(AlreadyExistsError):
        await tier.put(meta("k", 3), memoryview(b"abc"))
    assert len(list(tier.layout.objects.rglob("*.kvt"))) == 1


@pytest.mark.parametrize("delay_steps", [0, 1, 2, 3, 5, 8, 13])
async def test_delete_during_read_never_returns_wrong_bytes(
    tier: SsdTier, delay_steps: int
) -> None:
    size = 6 * MiB
    data = payload(size, delay_steps)
    await tier.put(meta("k", size), memoryview(data))
    dst = aligned(size)
    reader = asyncio.ensure_future(tier.read_into("k", dst))
    for _ in range(delay_steps):
        await asyncio.sleep(0)
    await tier.delete("k")
    # Re-put the key with other bytes at once: the reader must not mix the two objects.
    other = payload(size, 99)
    writer = asyncio.ensure_future(tier.put(meta("k", size), memoryview(other)))
    try:
        await reader
        assert bytes(dst) == data
    except NotFoundError:
        pass
    await writer
    await tier.read_into("k", dst)
    assert bytes(dst) == other
    assert tier.quarantined_count == 0


async def test_delete(tier: SsdTier) -> None:
    await tier.put(meta("k", 3), memoryview(b"abc"))
    await tier.delete("k")
    assert not tier.contains("k") and tier.used_bytes() == 0
    assert list(tier.layout.objects.rglob("*.kvt")) == []
    with pytest.raises(NotFoundError):
        await tier.delete("k")
    with pytest.raises(NotFoundError):
        tier.get_meta("k")


async def test_cancelled_put_leaves_no_partial_object(tier: SsdTier) -> None:
    task = asyncio.ensure_future(tier.put(meta("k", 8 * MiB), memoryview(payload(8 * MiB))))
    await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await tier.close()  # waits for the put, which was not interrupted mid-file
    assert list(tier.layout.tmp.iterdir()) == []
    t2 = make_tier(tier.layout.root)
    await t2.start()
    if t2.contains("k"):
        dst = bytearray(8 * MiB)
        await t2.read_into("k", memoryview(dst))
        assert bytes(dst) == payload(8 * MiB)
    await t2.close()


async def test_close_waits_for_in_flight_io_then_refuses(tmp_path: Path) -> None:
    t = make_tier(tmp_path)
    await t.start()
    put = asyncio.ensure_future(t.put(meta("k", 16 * MiB), memoryview(payload(16 * MiB))))
    await asyncio.sleep(0)
    await t.close()
    assert put.done() and (await put).size_bytes == 16 * MiB
    with pytest.raises(UnavailableError):
        await t.put(meta("j", 1), memoryview(b"x"))


# -- O_DIRECT fallback, options, meters -------------------------------------------------------


def refuse_o_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every O_DIRECT open fail with EINVAL, as filesystems without it do."""
    real = os.open

    def fake_open(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real(path, flags, *args, **kw)

    monkeypatch.setattr(aligned_io.os, "open", fake_open)


async def test_buffered_fallback_when_o_direct_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_o_direct(monkeypatch)
    t = make_tier(tmp_path)
    await t.start()
    assert t.direct is False
    await round_trip(t, "k", payload(4097), aligned(4097), memoryview(bytearray(4097)))
    await t.close()
    with pytest.raises(InvalidArgumentError, match="refuses O_DIRECT"):
        await make_tier(tmp_path / "strict", o_direct=True).start()


async def test_put_falls_back_when_o_direct_stops_working(
    tier: SsdTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert tier.direct is True
    refuse_o_direct(monkeypatch)
    await round_trip(tier, "k", payload(MiB + 1), aligned(MiB + 1), aligned(MiB + 1))
    assert tier.direct is False and list(tier.layout.tmp.iterdir()) == []


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"bogus": 1}, "unknown ssd tier option"),
        ({"o_direct": "yes"}, "o_direct"),
        ({"queue_depth": 0}, "queue_depth"),
        ({"queue_depth": True}, "queue_depth"),
        ({"part_bytes": 1000}, "part_bytes"),
        ({"chunk_bytes": 1000}, "part_bytes"),  # the old name, checked as the new one
        ({"fsync": "no"}, "fsync"),
    ],
)
def test_bad_options_are_rejected(tmp_path: Path, options: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        make_tier(tmp_path, **options)


async def test_options_are_applied(tmp_path: Path) -> None:
    t = make_tier(tmp_path, queue_depth=2, part_bytes="64KiB", fsync=False, o_direct=True)
    await t.start()
    assert t.options.queue_depth == 2 and t.options.part_bytes == 65536 and t.direct
    await round_trip(t, "k", payload(MiB + 3), aligned(MiB + 3), aligned(MiB + 3))
    await t.close()


def test_the_old_name_of_part_bytes_is_read_as_it_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 17: ``part_bytes`` was ``chunk_bytes`` ("chunk" is LMCache's unit of KV); a config
    that still says it works for one release and logs what to write instead."""
    config = TierConfig("disk", "ssd", 1 << 30, str(tmp_path), {"chunk_bytes": "64KiB"})
    with caplog.at_level(logging.WARNING, logger="kvtierd.storage.ssd_options"):
        old = create_tier(config)
    assert isinstance(old, SsdTier) and old.options.part_bytes == 65536
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "ssd tier 'disk': option chunk_bytes is deprecated, use part_bytes" in record.message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvtierd.storage.ssd_options"):
        assert make_tier(tmp_path, part_bytes="64KiB").options == old.options
    assert caplog.records == []


def test_part_bytes_under_both_names_is_a_config_error(tmp_path: Path) -> None:
    """The two values could disagree: refused, naming the tier and the name to keep."""
    both = {"part_bytes": "64KiB", "chunk_bytes": "64KiB"}
    with pytest.raises(ConfigError) as e:
        create_tier(TierConfig("disk", "ssd", 1 << 30, str(tmp_path), both))
    assert str(e.value) == (
        "tier 'disk' (ssd): ssd options part_bytes and chunk_bytes both given: chunk_bytes is "
        "part_bytes's name before this release; give part_bytes only"
    )


async def test_read_fit_calibrated_at_start_and_refit_from_real_reads(
    tier: SsdTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert tier.read_meter.samples == 4  # two sizes (1 and 4 MiB here), each read twice
    assert tier.write_meter.samples == 2
    assert tier.read_meter.overhead_s >= 0
    assert tier.stats().read_bandwidth_bytes_per_s == tier.read_meter.bytes_per_s > 0
    assert tier.stats().write_bandwidth_bytes_per_s > 0
    assert list(tier.layout.tmp.iterdir()) == []  # the calibration files are gone
    await tier.put(meta("k", 4 * MiB), memoryview(payload(4 * MiB)))
    await tier.put(meta("small", 100), memoryview(bytes(100)))  # too small to say anything
    assert tier.write_meter.samples == 3

    # The disk gets much slower: the fit follows the reads the meter was given. Compared with
    # those (captured where the tier hands them over), not with the test's own clock around
    # read_into, so scheduling noise on a loaded machine moves both sides alike. Each read
    # sleeps at least 3x the calibrated load time, so a meter that stopped learning (still
    # predicting before_s) falls below every slow read, however slow calibration was.
    before_s = tier.read_meter.fit().seconds(4 * MiB)
    slowdown_s = max(0.01, 3 * before_s)
    real_read_part = ssd_module.read_part
    real_record = TransferMeter.record
    given_s: list[float] = []

    def slow_read_part(*args: Any, **kwargs: Any) -> None:
        time.sleep(slowdown_s)  # never returns early: every read lasts at least slowdown_s
        real_read_part(*args, **kwargs)

    def record(meter: TransferMeter, nbytes: int, seconds: float) -> None:
        if meter is tier.read_meter:
            assert nbytes == 4 * MiB
            given_s.append(seconds)
        real_record(meter, nbytes, seconds)

    monkeypatch.setattr(ssd_module, "read_part", slow_read_part)
    monkeypatch.setattr(TransferMeter, "record", record)
    dst = aligned(4 * MiB)
    for _ in range(30):
        await tier.read_into("k", dst)
    assert len(given_s) == 30 and min(given_s) >= slowdown_s
    assert tier.read_meter.samples == 34
    predicted_s = tier.read_meter.fit().seconds(4 * MiB)
    # An exponentially weighted fit over 30 slow reads: within the range of what it was given,
    # widened below for the 4 fast calibration reads (0.9 ** 30, about 4 % of the weight).
    assert 0.9 * min(given_s) <= predicted_s <= max(given_s)
    assert tier.stats().read_bandwidth_bytes_per_s == tier.read_meter.bytes_per_s


async def test_buffered_calibration_reads_the_disk_not_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without O_DIRECT every timed calibration read finds its file evicted from the page
    cache, the second round's too (the first round's reads cached it again)."""
    dropped: list[str] = []
    real_drop = ssd_probe.drop_cached_pages

    def drop(path: str) -> None:
        dropped.append(Path(path).name)
        real_drop(path)

    monkeypatch.setattr(ssd_probe, "drop_cached_pages", drop)
    t = make_tier(tmp_path, o_direct=False)
    await t.start()
    try:
        assert t.calibrated and t.read_meter.samples == 2 * ssd_probe.CALIBRATION_ROUNDS
        sizes = ssd_probe.calibration_sizes(t.options.part_bytes, t.options.queue_depth, 1 << 62)
        names = [f"calibration-{n}.kvt" for n in sizes]
        assert dropped == names * ssd_probe.CALIBRATION_ROUNDS  # once before every timed read
    finally:
        await t.close()


# -- crashes and a real full disk -------------------------------------------------------------

_WRITER = """
import asyncio, sys
import numpy as np
from kvtierd.config import TierConfig
from kvtierd.storage.ssd import SsdTier
from kvtierd.types import ObjectMeta
async def main(path, first):
    t = SsdTier(TierConfig("ssd", "ssd", 1 << 30, path, {"part_bytes": "256KiB"}))
    await t.start()
    for i in range(first, first + 10_000):
        size = 1 + (i * 7919) % (3 << 20)
        data = np.random.default_rng(i).bytes(size)
        await t.put(ObjectMeta(key=f"k{i}", size_bytes=size), memoryview(data))
        sys.stdout.write(f"ACK {i} END\\n")  # one write; END marks the line complete
        sys.stdout.flush()
asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""

_ACK = re.compile(r"ACK (\d+) END\n")


def _acks(text: str) -> list[int]:
    """Ids acknowledged in a killed writer's output: complete lines only. The kill can cut
    the last line anywhere ("ACK 1" of "ACK 12 END"), and a cut line acknowledges nothing."""
    found = (_ACK.fullmatch(line) for line in text.splitlines(keepends=True))
    return [int(m.group(1)) for m in found if m]


def test_a_cut_acknowledgement_is_not_read_as_one() -> None:
    assert _acks("ACK 11 END\nACK 12 END\nACK 1") == [11, 12]
    assert _acks("ACK 11 END\nACK 12 EN") == [11]
    assert _acks("ACK 11 END\nACK 12 END\n") == [11, 12]


async def test_sigkill_during_writes_loses_no_acknowledged_object(tmp_path: Path) -> None:
    """Kill a writer process at random points, restart: every acknowledged object is intact,
    no partial object is visible, no temp file survives."""
    rng = np.random.default_rng(7)
    acked: list[int] = []
    first = 0
    for _ in range(6):
        proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(tmp_path), str(first)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert proc.stdout is not None
        for _ in range(int(rng.integers(2, 8))):
            line = proc.stdout.readline()  # the writer is alive: lines arrive whole
            assert len(_acks(line)) == 1, line
            acked += _acks(line)
        await asyncio.sleep(float(rng.uniform(0, 0.02)))  # land inside a put
        proc.kill()
        proc.wait()
        acked += _acks(proc.stdout.read())
        t = make_tier(tmp_path)
        await t.start()
        assert t.quarantined_count == 0 and list((tmp_path / "tmp").iterdir()) == []
        held = {m.key: m for m in t.metas()}
        assert {f"k{i}" for i in acked} <= set(held)
        for key, m in held.items():  # acknowledged or not, whatever is visible is whole
            dst = bytearray(m.size_bytes)
            await t.read_into(key, memoryview(dst))
            assert bytes(dst) == payload(m.size_bytes, int(key[1:]))
        first = max(int(k[1:]) for k in held) + 1 if held else 0
        await t.close()
    assert len(acked) >= 12


async def test_real_full_disk(tmp_path: Path) -> None:
    """A 6 MiB tmpfs (needs root): puts fail with StorageFullError, reads go on."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)],
        capture_output=True, check=False,
    )  # fmt: skip
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mount.stderr!r}")
    try:
        t = make_tier(mnt)
        await t.start()  # the calibration files do not fit: skipped, not fatal
        assert not t.calibrated and "not calibrated" in t.stats().detail
        stored = []
        with pytest.raises(StorageFullError, match="No space left"):
            for i in range(10):
                await t.put(meta(f"k{i}", MiB), memoryview(payload(MiB, i)))
                stored.append(i)
        assert 2 <= len(stored) < 6 and list(t.layout.tmp.iterdir()) == []
        for i in stored:
            dst = bytearray(MiB)
            await t.read_into(f"k{i}", memoryview(dst))
            assert bytes(dst) == payload(MiB, i)
        await t.delete("k0")  # room again
        await t.put(meta("again", MiB), memoryview(payload(MiB)))
        await t.close()
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_decoded_metadata_shares_the_strings_most_objects_have() -> None:
    """A restart decodes one header (or checkpoint row) per object; each kept its own copy
    of "none", "uint8", the layout and the tenant: ~100 bytes an object at 100k objects."""

    def doc(key: str) -> dict[str, object]:
        return {"key": key, "context_id": "c" + key, "variant": "none", "dtype": "uint8",
                "layout": "KV_2LTD", "tenant": "team", "size_bytes": 1, "token_count": 0,
                "shape": [], "checksum": "0" * 16}  # fmt: skip

    a, b = (meta_from_doc(json.loads(json.dumps(doc(k))), b"") for k in ("k1", "k2"))
    for name in ("variant", "dtype", "layout", "tenant"):
        assert getattr(a, name) is getattr(b, name), name
    assert a.key == "k1" and b.context_id == "ck2"
