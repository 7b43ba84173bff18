"""The same contract checked on every registered tier kind (generated from the registry):
a new tier is tested by adding one config builder below, and a kind without one fails."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtierd import errors
from kvtierd.config import TierConfig
from kvtierd.storage import create_tier
from kvtierd.types import ObjectMeta

MiB = 1 << 20


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _cpu(tmp: Path, request: pytest.FixtureRequest) -> TierConfig:
    return TierConfig("cpu", "cpu", 64 * MiB, options={"staging_bytes": 64 * MiB})


def _ssd(tmp: Path, request: pytest.FixtureRequest) -> TierConfig:
    return TierConfig("ssd", "ssd", 256 * MiB, str(tmp / "ssd"))


def _gpu(tmp: Path, request: pytest.FixtureRequest) -> TierConfig:
    if not _cuda():
        pytest.skip("gpu tier: no CUDA on this machine (run with -m gpu on the device machine)")
    return TierConfig("gpu", "gpu", 256 * MiB)


def _remote(tmp: Path, request: pytest.FixtureRequest) -> TierConfig:
    cluster = request.getfixturevalue("redis_cluster")
    options = {"nodes": cluster.addresses, "namespace": f"m{uuid.uuid4().hex[:8]}",
               "value_bytes": MiB}  # fmt: skip
    return TierConfig("remote", "remote", 0, options=options)


BUILDERS: dict[str, Callable[[Path, pytest.FixtureRequest], TierConfig]] = {
    "cpu": _cpu,
    "ssd": _ssd,
    "gpu": _gpu,
    "remote": _remote,
}


@pytest.fixture
async def tier(kind: str, tmp_path: Path, request: pytest.FixtureRequest):
    if kind not in BUILDERS:
        pytest.fail(f"tier kind {kind!r} is registered but has no test config in BUILDERS")
    t = create_tier(BUILDERS[kind](tmp_path, request))
    await t.start()
    yield t
    await t.close()


def meta(key: str, size: int) -> ObjectMeta:
    return ObjectMeta(key=key, size_bytes=size, context_id="ctx", dtype="uint8", shape=(size,))


@pytest.mark.parametrize("size", [1, 4095, 4097, 3 * MiB + 5])
async def test_round_trip(tier, size):
    data = os.urandom(size)
    stored = await tier.put(meta(f"k{size}", size), memoryview(data))
    assert stored.key == f"k{size}" and stored.size_bytes == size
    out = bytearray(size + 4096)
    got = await tier.read_into(f"k{size}", memoryview(out))
    assert bytes(out[:size]) == data
    assert got.context_id == "ctx" and got.shape == (size,)
    assert tier.contains(f"k{size}")
    assert tier.get_meta(f"k{size}").size_bytes == size


async def test_accounting_and_delete(tier):
    base_used, base_count = tier.used_bytes(), tier.object_count()
    await tier.put(meta("a", 1000), memoryview(b"a" * 1000))
    await tier.put(meta("b", 3000), memoryview(b"b" * 3000))
    assert tier.used_bytes() - base_used == 4000
    assert tier.object_count() - base_count == 2
    assert {m.key for m in tier.metas()} >= {"a", "b"}
    await tier.delete("a")
    assert not tier.contains("a")
    assert tier.used_bytes() - base_used == 3000
    stats = tier.stats()
    assert stats.name == tier.name and stats.object_count == tier.object_count()


async def test_errors(tier):
    await tier.put(meta("dup", 10), memoryview(b"x" * 10))
    with pytest.raises(errors.AlreadyExistsError):
        await tier.put(meta("dup", 10), memoryview(b"y" * 10))
    with pytest.raises(errors.NotFoundError):
        await tier.read_into("missing", memoryview(bytearray(10)))
    with pytest.raises(errors.NotFoundError):
        await tier.delete("missing")
    with pytest.raises(KeyError):
        tier.get_meta("missing")
    out = bytearray(10)
    await tier.read_into("dup", memoryview(out))
    assert bytes(out) == b"x" * 10  # the refused second put changed nothing


async def test_concurrent_puts_and_reads(tier):
    blobs = {f"c{i}": os.urandom(256 * 1024 + i) for i in range(8)}
    await asyncio.gather(*(tier.put(meta(k, len(v)), memoryview(v)) for k, v in blobs.items()))
    outs = {k: bytearray(len(v)) for k, v in blobs.items()}
    await asyncio.gather(*(tier.read_into(k, memoryview(outs[k])) for k in blobs))
    assert all(bytes(outs[k]) == v for k, v in blobs.items())


async def test_racing_puts_of_one_key_store_one_object(tier):
    blobs = [os.urandom(MiB), os.urandom(MiB)]
    base_used, base_count = tier.used_bytes(), tier.object_count()
    results = await asyncio.gather(
        *(tier.put(meta("race", MiB), memoryview(b)) for b in blobs), return_exceptions=True
    )
    assert [type(r) for r in results].count(errors.AlreadyExistsError) == 1
    assert tier.used_bytes() - base_used == MiB and tier.object_count() - base_count == 1
    out = bytearray(MiB)
    await tier.read_into("race", memoryview(out))
    assert bytes(out) in blobs


async def test_bandwidth_is_measured(tier):
    reads, writes = tier.read_meter.samples, tier.write_meter.samples  # start-up calibration
    data = os.urandom(4 * MiB)
    await tier.put(meta("bw", len(data)), memoryview(data))
    await tier.read_into("bw", memoryview(bytearray(len(data))))
    assert (tier.read_meter.samples, tier.write_meter.samples) == (reads + 1, writes + 1)
    stats = tier.stats()
    assert stats.read_bandwidth_bytes_per_s > 0 and stats.write_bandwidth_bytes_per_s > 0
