"""``bench``: put + get through a real daemon vs a memcpy measured in the same run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from benchmarks._support.daemon_proc import DaemonProcess
from kvtierd.client import KVClient
from tests.cli.conftest import Ctl

Start = Callable[..., DaemonProcess]
Bind = Callable[[DaemonProcess | None], Ctl]


def test_arena_and_stream_paths_json(start_daemon: Start, ctl: Bind) -> None:
    d = start_daemon(cpu="64MiB")
    r = ctl(d)("bench", "--mib", "8", "--repeat", "2", "--stream", "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["mib"] == 8 and doc["repeat"] == 2 and doc["daemon_version"]
    assert doc["memcpy_gb_per_s"] > 0.1
    assert [p["path"] for p in doc["paths"]] == ["arena", "stream"]
    moved = 2 * 8 * 2**20 / 1e9
    for p in doc["paths"]:
        assert p["seconds"] > 0 and p["gb_per_s"] == moved / p["seconds"]
        assert p["ratio"] == doc["memcpy_seconds"] / p["seconds"]
        assert 0 < p["ratio"] < 1.5  # a put + get cannot beat two plain copies by much
    with KVClient(d.socket_path) as c:  # every bench object was deleted again
        assert c.status().objects == 0


def test_table_arena_only(start_daemon: Start, ctl: Bind) -> None:
    r = ctl(start_daemon())("bench", "--mib", "4", "--repeat", "1")
    assert r.code == 0, r.err
    assert "arena" in r.out and "stream" not in r.out and "memcpy GB/s" in r.out


def test_object_larger_than_the_daemon_allows(start_daemon: Start, ctl: Bind) -> None:
    r = ctl(start_daemon(cpu="16MiB", ssd="16MiB"))("bench", "--mib", "32", "--repeat", "1")
    assert r.code == 5 and "larger than" in r.err and r.out == ""


def test_unreachable_and_usage(ctl: Bind, tmp_path: Path) -> None:
    run = ctl(None)
    r = run("bench", "--socket", str(tmp_path / "none.sock"))
    assert r.code == 3 and str(tmp_path / "none.sock") in r.err and "./scripts/serve" in r.err
    assert run("bench", "--address", "localhost:1").code == 2
    assert run("bench", "--socket", str(tmp_path / "x"), "--mib", "0").code == 2
