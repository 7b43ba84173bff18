"""A daemon's shared-memory arena (150-200 MiB per daemon in these tests) must not outlive it.
Crash tests that left them in /dev/shm filled it (on this machine 719 leaked arenas, 23 GiB of
memory, until the OOM killer stepped in). By default the arena is a memfd (nothing named to
leak); with ``arena_dir`` a SIGKILLed daemon's file is removed when a daemon starts there."""

from __future__ import annotations

import yaml

from benchmarks._support.arenas import ARENA_DIR, arenas_of


def test_default_memfd_arena_leaves_nothing_after_sigkill(start_daemon):
    d = start_daemon()
    pid = d.proc.pid
    assert not arenas_of(pid), "the default arena should be a memfd, not a /dev/shm file"
    d.kill()
    assert not list(ARENA_DIR.glob(f"kvtierd-{pid}-*"))


def test_file_arena_of_a_killed_daemon_is_removed_at_the_next_start(start_daemon, tmp_path):
    shm = tmp_path / "arenas"
    shm.mkdir()
    d = start_daemon()
    doc = yaml.safe_load(d.config.read_text())
    doc["tiers"][0]["options"]["arena_dir"] = str(shm)
    d.config.write_text(yaml.safe_dump(doc))
    d.kill()
    d.start()
    first = sorted(shm.glob(f"kvtierd-{d.proc.pid}-*.arena"))
    assert first, "with arena_dir the arena is a file there"
    d.kill()
    assert first[0].exists()  # SIGKILL: nothing could remove it
    d.start()
    assert not first[0].exists(), "the next start should remove the dead daemon's arena"
    d.stop()
    assert not list(shm.glob("*.arena")), "SIGTERM removes the daemon's own arena"
