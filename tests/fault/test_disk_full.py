"""SSD disk full: the SSD tier lives on an 8 MiB tmpfs, while its configured capacity (64 MiB)
says there is room, so the device itself runs out (ENOSPC) - the case a capacity check cannot
catch. Durable puts and demotions are refused with ``RESOURCE_EXHAUSTED`` and a message that
says the disk is full; reads go on; no half-written file stays behind; nothing acknowledged is
lost, across a restart too; freeing space makes durable puts work again.

Mounting needs root (CAP_SYS_ADMIN); without it the test skips and says so.
"""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest

from benchmarks._support.daemon_proc import DaemonProcess, write_config
from benchmarks._support.workload import payload
from kvtierd import errors
from kvtierd.client import KVClient
from tests.fault.remote_setup import settle

pytestmark = pytest.mark.slow
MiB = 1 << 20
OBJECT_BYTES = MiB
MAX_PUTS = 20  # 8 MiB of tmpfs holds at most 7 of them with their headers


@pytest.fixture
def small_disk(tmp_path: Path):
    mount_point = tmp_path / "d" / "ssd"
    mount_point.mkdir(parents=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount an 8 MiB tmpfs (needs root): {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def _start(directory: Path) -> DaemonProcess:
    config = write_config(directory, cpu="64MiB", ssd="64MiB")
    d = DaemonProcess(config, str(directory / "kvtierd.sock"), directory / "daemon.log")
    return d.start()


def _fill(c: KVClient) -> tuple[list[str], errors.KvtierError]:
    """Durable puts until the disk refuses one; returns the acknowledged keys and the error."""
    acknowledged: list[str] = []
    for i in range(MAX_PUTS):
        key = f"durable-{i}"
        try:
            c.put(key, payload(key, OBJECT_BYTES), context_id=key, durable=True)
        except errors.KvtierError as e:
            return acknowledged, e
        acknowledged.append(key)
    pytest.fail(f"{MAX_PUTS} MiB of durable puts fitted on an 8 MiB disk")


def test_disk_full_refuses_writes_keeps_reads_and_acknowledged_objects(tmp_path, small_disk):
    d = _start(tmp_path / "d")
    try:
        with KVClient(d.socket_path, timeout_s=30) as c:
            acknowledged, refusal = _fill(c)
            assert acknowledged, "not one durable put fitted on the 8 MiB disk"
            assert isinstance(refusal, errors.CapacityError), repr(refusal)
            text = str(refusal).lower()
            assert "space" in text or "full" in text, f"unclear message: {refusal}"

            for key in acknowledged:  # reads go on
                assert bytes(c.get(key)) == payload(key, OBJECT_BYTES), key
            c.put("volatile", payload("volatile", MiB), context_id="volatile")  # cpu has room
            assert bytes(c.get("volatile")) == payload("volatile", MiB)

            # A demotion needs the full disk: refused cleanly, the context stays readable.
            with contextlib.suppress(errors.CapacityError):
                c.drain("cpu")
            settle(c)
            assert bytes(c.get("volatile")) == payload("volatile", MiB)
            assert c.status().health == "SERVING" or "ssd" in c.status().health
            leftovers = [p.name for p in (small_disk / "tmp").iterdir() if p.suffix == ".tmp"]
            assert not leftovers, f"half-written files left on the full disk: {leftovers}"

            # Freeing space makes durable puts work again.
            assert c.delete(acknowledged[:2]) == 2
            c.put("after-free", payload("after-free", MiB), context_id="after", durable=True)
            kept = [*acknowledged[2:], "after-free"]
        d.stop()  # SIGTERM; the acknowledged durable objects must come back from the disk
        d.start()
        with KVClient(d.socket_path, timeout_s=30) as c:
            assert all(c.lookup(kept).found), dict(zip(kept, c.lookup(kept).found, strict=True))
            for key in kept:
                assert bytes(c.get(key)) == payload(key, OBJECT_BYTES), key
    finally:
        d.kill()


def test_refused_durable_put_can_be_retried(tmp_path, small_disk):
    d = _start(tmp_path / "d")
    try:
        with KVClient(d.socket_path, timeout_s=30) as c:
            acknowledged, _ = _fill(c)
            refused = f"durable-{len(acknowledged)}"
            c.delete(acknowledged)  # room again
            c.put(refused, payload(refused, OBJECT_BYTES), context_id=refused, durable=True)
            assert bytes(c.get(refused)) == payload(refused, OBJECT_BYTES)
    finally:
        d.kill()
