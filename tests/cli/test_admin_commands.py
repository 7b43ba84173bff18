"""Every Admin command of kvtierctl against a real daemon; ``--json`` parsed and checked."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from benchmarks._support.daemon_proc import DaemonProcess
from kvtierd.client import KVClient
from tests.cli.conftest import Ctl, put_contexts

MiB = 1 << 20
SIZES = {"alpha": 3000, "beta": 1000, "gamma": 2000}


def test_status_and_tiers(start_daemon: Callable[..., DaemonProcess], ctl: Callable) -> None:
    d = start_daemon(cpu="4MiB", ssd="16MiB")
    put_contexts(d, SIZES)
    with KVClient(d.socket_path) as c:
        c.get("alpha/0")
    run: Ctl = ctl(d)

    r = run("status", "--json")
    assert r.code == 0, r.err
    s = r.json()
    assert s["health"] == "SERVING"
    assert (s["contexts"], s["objects"], s["placer"], s["draining"]) == (3, 3, "lru", False)
    assert s["hits"] >= 1
    assert s["hit_rate"] == s["hits"] / (s["hits"] + s["misses"])

    r = run("tiers", "--json")
    assert r.code == 0, r.err
    tiers = {t["name"]: t for t in r.json()}
    assert list(tiers) == ["cpu", "ssd"]
    assert tiers["cpu"]["capacity_bytes"] == 4 * MiB
    assert tiers["ssd"]["capacity_bytes"] == 16 * MiB
    assert tiers["cpu"]["used_bytes"] == sum(SIZES.values())
    assert tiers["cpu"]["object_count"] == 3
    assert 0 <= tiers["cpu"]["hit_rate"] <= 1
    assert all(t["healthy"] for t in tiers.values())

    human = run("tiers")
    assert human.code == 0
    assert "cpu" in human.out and "4.0 MiB" in human.out and "16.0 MiB" in human.out
    human = run("status")
    assert "SERVING" in human.out and "lru" in human.out


def test_contexts_ls_sorts_and_filters(
    start_daemon: Callable[..., DaemonProcess], ctl: Callable
) -> None:
    d = start_daemon(cpu="4MiB", ssd="16MiB")
    put_contexts(d, SIZES)
    run: Ctl = ctl(d)

    def ids(*argv: str) -> list[str]:
        r = run("contexts", "ls", "--json", *argv)
        assert r.code == 0, r.err
        return [c["context_id"] for c in r.json()]

    assert ids() == ["gamma", "beta", "alpha"]  # most recent first
    assert ids("--sort", "size") == ["alpha", "gamma", "beta"]
    assert ids("--sort", "size", "--reverse") == ["beta", "gamma", "alpha"]
    assert ids("--sort", "id", "--limit", "2") == ["alpha", "beta"]
    assert ids("--tier", "ssd") == []
    with KVClient(d.socket_path) as c:
        c.get("beta/0")
        c.get("beta/0")
    assert ids("--sort", "hits", "--limit", "1") == ["beta"]
    assert run("pin", "gamma").code == 0
    assert ids("--pinned") == ["gamma"]
    assert set(ids("--unpinned")) == {"alpha", "beta"}
    assert ids("--variant", "none", "--sort", "id") == ["alpha", "beta", "gamma"]
    assert ids("--variant", "int8") == []
    rows = run("contexts", "ls", "--json", "--sort", "id").json()
    assert rows[0] == rows[0] | {"context_id": "alpha", "variant": "none", "tier": "cpu",
                                 "size_bytes": 3000, "objects": 1, "pinned": False}  # fmt: skip
    human = run("contexts", "ls", "--sort", "size")
    assert human.code == 0
    lines = [ln for ln in human.out.splitlines() if ln.split("│")[0].strip() in SIZES]
    assert [ln.split("│")[0].strip() for ln in lines] == ["alpha", "gamma", "beta"]
    bad = run("contexts", "ls", "--tier", "floppy")
    assert bad.code == 4 and "floppy" in bad.err


def test_contexts_show(start_daemon: Callable[..., DaemonProcess], ctl: Callable) -> None:
    d = start_daemon()
    put_contexts(d, SIZES)
    run: Ctl = ctl(d)
    r = run("contexts", "show", "beta", "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["summary"]["context_id"] == "beta"
    assert doc["summary"]["size_bytes"] == 1000
    assert [o["spec"]["key"] for o in doc["objects"]] == ["beta/0"]
    assert doc["objects"][0]["tier"] == "cpu"
    assert doc["reason"]
    human = run("contexts", "show", "beta")
    assert "beta/0" in human.out and "none in cpu" in human.out
    missing = run("contexts", "show", "nope")
    assert missing.code == 4
    assert missing.out == ""
    assert missing.err.count("\n") == 1 and "nope" in missing.err

    advised = run("contexts", "advise", "beta", "--json")
    assert advised.err == ""
    advice = advised.json()
    assert (advice["variant"], advice["tier"], advice["source"]) == ("none", "cpu", "placed")
    new = run("contexts", "advise", "fresh", "--tokens", "512", "--size", "64MiB")
    assert new.code == 0 and "default" in new.out and "does not compress" in new.out
    bad = run("contexts", "advise", "fresh", "--size", "lots")
    assert bad.code != 0 and "--size" in bad.err and bad.err.count("\n") == 1
    # Its name before issue 17 still works for one release: the same output on stdout, a note
    # on stderr naming the new one.
    old = run("contexts", "plan", "beta", "--json")
    assert (old.code, old.json()) == (0, advice)
    assert old.err.startswith("kvtierctl: note: `contexts plan` is deprecated")
    assert "`contexts advise`" in old.err and old.err.count("\n") == 1


def test_evict_pin_unpin_drain_rebalance(
    start_daemon: Callable[..., DaemonProcess], ctl: Callable
) -> None:
    d = start_daemon()
    put_contexts(d, SIZES)
    run: Ctl = ctl(d)

    r = run("pin", "alpha", "beta", "--json")
    assert (r.code, r.json()) == (0, {"changed": 2, "requested": 2})
    r = run("unpin", "beta", "--json")
    assert (r.code, r.json()) == (0, {"changed": 1, "requested": 1})
    pinned = {c["context_id"]: c["pinned"] for c in run("contexts", "ls", "--json").json()}
    assert pinned == {"alpha": True, "beta": False, "gamma": False}

    r = run("evict", "gamma", "--json")
    assert (r.code, r.json()) == (0, {"evicted": 1, "requested": 1})
    assert {c["context_id"] for c in run("contexts", "ls", "--json").json()} == {"alpha", "beta"}

    r = run("drain", "cpu", "--json")
    assert r.code == 0, r.err
    assert r.json()["moved"] + r.json()["dropped"] == 2
    tiers = {t["name"]: t for t in run("tiers", "--json").json()}
    assert tiers["cpu"]["object_count"] == 0
    assert tiers["ssd"]["used_bytes"] == 4000
    assert {c["tier"] for c in run("contexts", "ls", "--json").json()} == {"ssd"}

    r = run("rebalance", "--json")
    assert r.code == 0, r.err
    assert set(r.json()) == {"operations", "moved", "dropped", "compressed"}
    assert "rebalanced:" in run("rebalance").out
    assert run("drain", "floppy").code == 4


def test_contexts_of_a_busy_daemon_show_hits(
    start_daemon: Callable[..., DaemonProcess], ctl: Callable
) -> None:
    d = start_daemon()
    with KVClient(d.socket_path) as c:
        c.put("k", np.arange(256, dtype=np.float32), context_id="doc")
        for _ in range(3):
            c.get("k")
    (row,) = ctl(d)("contexts", "ls", "--json").json()
    assert row["hits"] == 3


def test_tiers_report_hits_per_tier(
    start_daemon: Callable[..., DaemonProcess], ctl: Callable
) -> None:
    d = start_daemon()
    put_contexts(d, {"a": 100})
    with KVClient(d.socket_path) as c:
        c.get("a/0")
    tiers = {t["name"]: t for t in ctl(d)("tiers", "--json").json()}
    assert tiers["cpu"]["hits"] == 1
    assert tiers["cpu"]["hit_rate"] > 0


def test_contexts_ls_draws_the_tree_and_show_gives_ancestors_and_descendants(
    start_daemon: Callable[..., DaemonProcess], ctl: Callable
) -> None:
    """Issue 29: one system prompt, two documents after it (the second splits the first
    request's context at the branch), and a third prompt branching inside the first one."""
    d = start_daemon()
    chunk = np.ones(2048, np.uint8)
    with KVClient(d.socket_path) as c:
        for keys, after in ((["s0", "s1", "a0", "a1"], ""), (["b0"], "s1"), (["x0"], "a0")):
            advice = c.advise(keys[0], after_key=after)
            for key in keys:
                c.put(key, chunk, context_id=advice.context_id,
                      parent_context_id=advice.parent_context_id)  # fmt: skip
    run: Ctl = ctl(d)
    listed = run("contexts", "ls", "--sort", "id")
    assert listed.code == 0, listed.err
    drawn = [line.split("│")[0].rstrip() for line in listed.out.splitlines()
             if " none " in line]  # fmt: skip
    assert drawn == ["s0", "└ a0", "  └ a1", "  └ x0", "└ b0"]
    rows = run("contexts", "ls", "--json").json()
    assert {r["context_id"]: r.get("parent_context_id", "") for r in rows} == {
        "s0": "", "a0": "s0", "a1": "a0", "x0": "a0", "b0": "s0",
    }  # fmt: skip
    shown = run("contexts", "show", "x0")
    assert shown.code == 0, shown.err
    assert "a0 > s0" in shown.out
    assert "refused: it continues context 'a0'" in shown.out
    top = run("contexts", "show", "s0")
    assert "descendants" in top.out and "└ a0" in top.out and "  └ x0" in top.out


def test_lookups_that_find_nothing_are_misses(
    start_daemon: Callable[..., DaemonProcess], ctl: Callable
) -> None:
    """Issue 41's run: one of six requests a full miss and two partial showed "hit rate 100%"
    (misses counted only failed reads). A served request's lookup (``request=True``, the
    plugin's lookup of a prompt) counts by outcome, and its chunks not found are misses, in
    the status, each tier's hit rate and the metrics; single-key lookups count nothing."""
    from benchmarks._support.daemon_proc import metrics_port
    from tests.cli.test_metrics_endpoint import scrape

    d = start_daemon(cpu="4MiB", metrics_port="any")
    stored = [f"p{i}" for i in range(4)]
    requests = [stored, stored, ["p0", "p1", "q2", "q3"], ["p0", "p1", "p2", "r3"],
                ["z0", "z1", "z2", "z3"], stored]  # fmt: skip
    with KVClient(d.socket_path) as c:
        for key in stored:
            c.put(key, np.zeros(1024, np.uint8), context_id="p0")
        assert c.lookup(["z9"]).prefix_hits == 0  # not a request's: not counted
        for keys in requests:
            found = c.lookup(keys, request=True).prefix_hits
            for key in keys[:found]:  # vLLM loads the prefix found, computes the rest
                c.get(key)
    run: Ctl = ctl(d)
    s = run("status", "--json").json()
    assert (s["lookups_hit"], s["lookups_partial"], s["lookups_missed"]) == (3, 2, 1)
    assert (s["hits"], s["misses"]) == (17, 7)  # 4+4+2+3+0+4 read; 0+0+2+1+4+0 not found
    assert s["hit_rate"] == 17 / 24
    human = run("status").out
    assert "6 (3 hit, 2 partial, 1 missed)" in human and "70.8% of chunks" in human, human
    (cpu,) = [t for t in run("tiers", "--json").json() if t["name"] == "cpu"]
    assert cpu["hit_rate"] == 17 / 24
    got = scrape(metrics_port(d))
    lookups = {
        o: got[("kvtierd_lookups_total", (("outcome", o),))] for o in ("hit", "partial", "miss")
    }
    assert lookups == {"hit": 3, "partial": 2, "miss": 1}
    assert got[("kvtierd_misses_total", ())] == 7
    assert got[("kvtierd_tier_hit_ratio", (("tier", "cpu"),))] == 17 / 24
