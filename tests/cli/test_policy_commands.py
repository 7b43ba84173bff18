"""``policy show|validate|apply`` against a real daemon: hot reload, and a bad file rejected whole
with its line number while the running policy stays."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks._support.daemon_proc import DaemonProcess
from kvtierd.client import KVClient
from tests.cli.conftest import Ctl, put_contexts

POLICIES = Path(__file__).resolve().parents[2] / "configs" / "policies"

BAD = """\
name: broken
placer: evicpress
alpha: 2.0
variants:
  methods: [knorm, zstd]
"""


def test_validate_needs_no_daemon(ctl: Callable, tmp_path: Path) -> None:
    run: Ctl = ctl(None)
    r = run("policy", "validate", str(POLICIES / "evicpress.yaml"), "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert (doc["valid"], doc["placer"], doc["alpha"], doc["variants"]) == (
        True, "evicpress", 1.0, 30,
    )  # fmt: skip
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD)
    r = run("policy", "validate", str(bad))
    assert r.code == 5
    assert r.out == ""
    assert r.err == (
        f"kvtierctl: {bad}:5: variants.methods.1: unknown method 'zstd'; allowed values: "
        "keydiff, knorm, paged_eviction, paged_eviction_block, snapkv, streamingllm, int8, int4 "
        "or <drop method>+<quantization> (e.g. knorm+int8)\n"
    )
    assert run("policy", "validate", str(tmp_path / "missing.yaml")).code == 5


def test_the_old_evaluator_name_is_refused_with_the_new_one(ctl: Callable, tmp_path: Path) -> None:
    """``evaluator: engine`` (renamed ``served`` in issue 17) is not read as an alias: validate
    refuses it, naming the file, line and key, the new name and the allowed values."""
    old = tmp_path / "old.yaml"
    old.write_text(SERVED_ON_SHIPPED_GRID.replace("evaluator: served", "evaluator: engine"))
    r = ctl(None)("policy", "validate", str(old))
    assert (r.code, r.out) == (5, "")
    assert r.err == (
        f"kvtierctl: {old}:6: profiling.evaluator: 'engine' was renamed to 'served'; "
        "allowed values: attention, answer, served, query_attention\n"
    )


def test_show_apply_and_reject(
    start_daemon: Callable[..., DaemonProcess], ctl: Callable, tmp_path: Path
) -> None:
    d = start_daemon(policy_file="")  # the embedded default policy
    run: Ctl = ctl(d)
    shown = run("policy", "show", "--json").json()
    assert (shown["name"], shown["source"]) == ("evicpress", "embedded")

    lfu = str(POLICIES / "lfu.yaml")
    r = run("policy", "apply", lfu, "--dry-run", "--json")
    assert (r.code, r.json()["name"], r.json()["applied"]) == (0, "lfu", False)
    assert run("policy", "show", "--json").json()["name"] == "evicpress"

    r = run("policy", "apply", lfu, "--json")
    assert (r.code, r.json()["name"], r.json()["applied"]) == (0, "lfu", True)
    shown = run("policy", "show", "--json").json()
    assert (shown["name"], shown["source"]) == ("lfu", lfu)
    assert shown["yaml"] == Path(lfu).read_text()
    assert run("status", "--json").json()["placer"] == "lfu"
    assert "placer: lfu" in run("policy", "show").out

    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD)
    r = run("policy", "apply", str(bad))
    assert r.code == 5
    assert f"{bad}:5: variants.methods.1" in r.err
    assert run("policy", "show", "--json").json()["name"] == "lfu"  # the running one stays


def test_the_daemon_rejects_a_bad_document_with_its_line(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """Bypassing the CLI's own check: the daemon answers INVALID_ARGUMENT naming the line."""
    d = start_daemon()
    with KVClient(d.socket_path) as c:
        from kvtierd.errors import InvalidArgumentError
        from kvtierd.rpc import kvtier_pb2 as pb

        req = pb.ApplyPolicyRequest(yaml="placer: lru\nalpha: 3\n", source="p.yaml")
        with pytest.raises(InvalidArgumentError, match=r"p.yaml:2: alpha: unknown key"):
            c.call(c.admin.ApplyPolicy, req)
        assert c.call(c.admin.GetPolicy, pb.PolicyRequest()).name == "lru"


def test_hot_reload_is_observed_in_placements(
    start_daemon: Callable[..., DaemonProcess], ctl: Callable
) -> None:
    d = start_daemon()
    put_contexts(d, {"a": 1000, "b": 2000})
    run: Ctl = ctl(d)
    assert {c["tier"] for c in run("contexts", "ls", "--json").json()} == {"cpu"}
    assert run("policy", "apply", str(POLICIES / "prefill.yaml")).code == 0
    # prefill caches nothing: every context is dropped (or forgotten) after the reload.
    assert {c["tier"] for c in run("contexts", "ls", "--json").json()} <= {""}


SERVED_ON_SHIPPED_GRID = """\
name: served-everything
placer: evicpress
variants:
  methods: [knorm, keydiff, int8, int4, knorm+int8]
profiling:
  evaluator: served
  router_url: http://127.0.0.1:8100
"""
SERVED_REFUSED = (
    "{path}:6: profiling.evaluator: evaluator 'served' cannot score int8, int4 "
    "(quantization-only variants, from variants.methods int8, int4, knorm+int8 at ratio 1.0)"
)


def test_a_grid_the_evaluator_cannot_score_is_refused_at_validate_and_apply(
    start_daemon: Callable[..., DaemonProcess], ctl: Callable, tmp_path: Path
) -> None:
    """``served`` with the shipped grid failed every profile (``cannot score 'int8'``) after
    validate and apply had accepted it: both refuse it now, naming variants and evaluator."""
    path = tmp_path / "served.yaml"
    path.write_text(SERVED_ON_SHIPPED_GRID)
    d = start_daemon()
    run: Ctl = ctl(d)
    for command in (("validate",), ("apply",), ("apply", "--dry-run")):
        r = run("policy", *command, str(path))
        assert r.code == 5, (command, r.out)
        assert r.err.startswith(f"kvtierctl: {SERVED_REFUSED.format(path=path)}"), r.err
    assert run("policy", "show", "--json").json()["name"] != "served-everything"
    # The daemon refuses it too, whoever sends it.
    with KVClient(d.socket_path) as c:
        from kvtierd.errors import InvalidArgumentError
        from kvtierd.rpc import kvtier_pb2 as pb

        req = pb.ApplyPolicyRequest(yaml=SERVED_ON_SHIPPED_GRID, source="e.yaml")
        with pytest.raises(InvalidArgumentError, match="served' cannot score int8, int4"):
            c.call(c.admin.ApplyPolicy, req)
    # Without the quantization-only variants the same evaluator is accepted.
    path.write_text(SERVED_ON_SHIPPED_GRID.replace("int8, int4, knorm+int8", "knorm+int8")
                    .replace("variants:\n", "variants:\n  ratios: [0.5, 0.25]\n"))  # fmt: skip
    assert run("policy", "validate", str(path)).code == 0
