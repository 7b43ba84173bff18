"""A pooled tier whose free bytes are in holes (issue 40.9): the placer counts bytes, so a
place it plans must not fail for want of one contiguous block while the bytes are free. The
pool is compacted (unleased objects slide down); an object leased in place never moves; a
placement that fails all the same (every object in the way leased) is adopted where the
context is, so the placer plans it again later.

The CPU tier's arena shows it with the same allocator as the GPU pool: 1 MiB of capacity and
256 KiB of staging, filled in this order (K = KiB, LRU placer, each step settled)::

    w@0(512K) x0@512K y0@640K x1@768K y1@896K   -> full
    x2@1024K                                     -> w spills to the SSD tier, [0, 512K) free
    y2@1152K (best fit) x3@0 y3@128K              -> 1 MiB held again
    delete y0..y3                                -> 768K free in four holes, the largest 384K

A touch of ``w`` then promotes it (the placer sees 512K of room) into a pool with no 512K block.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

from kvtierd.client import KVClient

KiB = 1 << 10


def _settle(c: KVClient) -> None:
    deadline = time.monotonic() + 20
    while c.status().pending_plans and time.monotonic() < deadline:
        time.sleep(0.01)


def _tiers(c: KVClient) -> dict[str, str]:
    return {ctx.context_id: ctx.tier for ctx in c.contexts()}


def _fragment(c: KVClient) -> None:
    def put(name: str, size_kib: int, fill: int) -> None:
        c.put(name, np.full(size_kib * KiB, fill, np.uint8), context_id=name)
        _settle(c)

    put("w", 512, 7)
    for i in range(2):
        put(f"x{i}", 128, 10 + i)
        put(f"y{i}", 128, 20 + i)
    put("x2", 128, 12)
    assert _tiers(c)["w"] == "ssd"
    put("y2", 128, 22)
    put("x3", 128, 13)
    put("y3", 128, 23)
    assert c.delete(["y0", "y1", "y2", "y3"]) == 4
    _settle(c)
    cpu = next(t for t in c.tiers() if t.name == "cpu")
    assert cpu.used_bytes == 512 * KiB  # the placer's room for w is there, in holes
    assert set(_tiers(c).values()) == {"cpu", "ssd"}


def test_a_place_into_a_fragmented_pool_compacts_it_and_never_moves_a_lease(start_daemon):
    """First every object in the way is leased: nothing can slide, the promotion fails, and
    the placer learns that ``w`` is still on SSD — so the next access plans it again (had the
    placer kept believing it in the CPU tier, no access would ever move it there). Then only
    ``x0`` (at 512K, above the hole the slide fills) stays leased: the others slide down, ``w``
    is placed, and the bytes read through ``x0``'s lease are its own all along. Before the
    compaction the second promotion failed as the first did: ``no free block of 524288 bytes
    (free 786432 bytes in 4 blocks, largest 393216)``."""
    d = start_daemon(cpu="1MiB", ssd="16MiB", cpu_staging="256KiB")
    with KVClient(d.socket_path, timeout_s=20) as c, contextlib.ExitStack() as held:
        _fragment(c)
        _, x0 = held.enter_context(c.lease("x0"))
        with contextlib.ExitStack() as others:
            for name in ("x1", "x2", "x3"):
                others.enter_context(c.lease(name))
            c.touch(["w"])
            _settle(c)
            assert _tiers(c)["w"] == "ssd"
            assert d.log.read_text().count("plan operation move on 'w' failed") == 1
        c.touch(["w"])
        _settle(c)
        assert _tiers(c)["w"] == "cpu"
        assert bytes(x0) == bytes([10]) * (128 * KiB)  # never moved under its lease
        assert "compacted for a block of 524288 bytes: moved 2 objects" in d.log.read_text()
        for name, fill in (("x1", 11), ("x2", 12), ("x3", 13), ("w", 7)):
            got = c.get(name)
            assert got.size and (got == fill).all(), name
    assert d.log.read_text().count("plan operation") == 1
