"""Leases for CUDA processes (``Get`` with ``device_ok``): an object in a gpu tier is handed out
in place through CUDA IPC and never moved or freed under the reader; any other object comes
as a CPU tensor over its bytes in the arena. The gpu cases need the device machine."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from benchmarks._support.daemon_proc import DaemonProcess
from kvtierd.client import KVClient

MiB = 1 << 20


def test_device_lease_without_a_gpu_tier_reads_the_arena(start_daemon):
    d = start_daemon(cpu="8MiB", ssd="64MiB")
    data = np.random.default_rng(0).integers(0, 255, 3 * MiB, dtype=np.uint8)
    with KVClient(d.socket_path) as c:
        c.put("a", data)
        for i in range(4):  # push "a" down to the SSD tier: it is staged for the lease
            c.put(f"fill{i}", np.zeros(3 * MiB, np.uint8))
        _until_in(c, "a", "ssd")  # demotions run in the background
        with c.device_lease("a") as (info, t):
            assert t.device.type == "cpu" and t.dtype == torch.uint8
            assert info.spec.size_bytes == data.nbytes
            assert np.array_equal(t.numpy(), data)
        assert c.status().leases == 0


def _gpu_daemon(tmp: Path) -> DaemonProcess:
    tmp.mkdir(parents=True, exist_ok=True)
    lru = tmp / "lru.yaml"
    lru.write_text("name: lru\nplacer: lru\n")
    doc = {
        "socket_path": str(tmp / "kvtierd.sock"),
        "data_dir": str(tmp / "data"),
        "policy_file": str(lru),
        "tiers": [
            {"name": "gpu", "kind": "gpu", "capacity": "64MiB"},
            {"name": "cpu", "kind": "cpu", "capacity": "64MiB"},
            {"name": "ssd", "kind": "ssd", "capacity": "256MiB", "path": str(tmp / "ssd")},
        ],
    }
    (tmp / "kvtierd.yaml").write_text(yaml.safe_dump(doc))
    return DaemonProcess(tmp / "kvtierd.yaml", str(tmp / "kvtierd.sock"), tmp / "log").start()


def _until_in(c: KVClient, key: str, tier: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while c.lookup([key]).tiers != (tier,):
        assert time.monotonic() < deadline, f"{key!r} never reached tier {tier}"
        time.sleep(0.05)


@pytest.mark.gpu
def test_gpu_object_is_leased_in_place_and_survives_delete(tmp_path: Path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (run with -m gpu on the device machine)")
    d = _gpu_daemon(tmp_path / "d")
    try:
        data = torch.randint(0, 255, (4 * MiB,), dtype=torch.uint8)
        with KVClient(d.socket_path) as c:
            c.put("g", data)
            _until_in(c, "g", "gpu")
            gpu_used = next(t.used_bytes for t in c.tiers() if t.name == "gpu")
            with c.device_lease("g") as (_, view):
                assert view.is_cuda and view.numel() == data.numel()
                assert torch.equal(view.cpu(), data)
                c.delete(["g"])  # the reader keeps its bytes until it releases
                assert not c.lookup(["g"]).found[0]
                assert torch.equal(view.cpu(), data)
                still = next(t.used_bytes for t in c.tiers() if t.name == "gpu")
                assert still == gpu_used - data.numel()  # accounted gone, block not reused
                c.put("h", torch.full((4 * MiB,), 7, dtype=torch.uint8))
                assert torch.equal(view.cpu(), data), "a new object overwrote a leased block"
            assert c.status().leases == 0
            # Demoted out of the gpu tier, an object comes through the arena.
            c.drain("gpu")
            assert c.lookup(["h"]).tiers == ("cpu",)
            with c.device_lease("h") as (_, cpu_t):
                assert cpu_t.device.type == "cpu" and int(cpu_t[0]) == 7
    finally:
        d.stop()
