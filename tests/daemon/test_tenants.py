"""Tenants: separate namespaces (no reading, deleting or evicting across them), quotas per
tier, unknown tenants refused, Admin only for admins over TCP."""

from __future__ import annotations

import time

import numpy as np
import pytest
import yaml

from benchmarks._support.daemon_proc import certificate, tcp_listener, tcp_port
from kvtierd import errors
from kvtierd.client import KVClient

MiB = 1 << 20
TENANTS = [
    {"name": "a", "quota": {"cpu": "1MiB", "ssd": "4MiB"}},
    {"name": "b"},
]


def _settle(c: KVClient) -> None:
    deadline = time.monotonic() + 10
    while c.status().pending_plans and time.monotonic() < deadline:
        time.sleep(0.01)


def test_namespaces_are_separate(start_daemon):
    d = start_daemon(tenants=TENANTS)
    with (
        KVClient(d.socket_path, tenant="a") as a,
        KVClient(d.socket_path, tenant="b") as b,
    ):
        a.put("k", b"from a" * 100, context_id="doc")
        assert b.lookup(["k"]).found == (False,)
        with pytest.raises(errors.NotFoundError):
            b.get("k")
        assert b.delete(["k"]) == 0  # cannot delete another tenant's object
        b.put("k", b"from b" * 100, context_id="doc")
        assert bytes(a.get("k")) == b"from a" * 100
        assert bytes(b.get("k")) == b"from b" * 100
        info = a.put("k2", b"x")
        assert info.spec.key == "k2"  # names come back as the tenant gave them
    with KVClient(d.socket_path) as admin:
        ids = sorted(c.context_id for c in admin.contexts())
        assert ids == ["a/doc", "a/k2", "b/doc"]
    with (
        KVClient(d.socket_path, tenant="nobody") as x,
        pytest.raises(errors.PermissionDeniedError, match="unknown tenant 'nobody'"),
    ):
        x.lookup(["k"])


def test_quota_per_tier_and_total(start_daemon):
    d = start_daemon(tenants=TENANTS)
    with KVClient(d.socket_path, tenant="a") as a, KVClient(d.socket_path) as admin:
        for i in range(3):
            a.put(f"c{i}", np.full(MiB, i, np.uint8), context_id=f"c{i}")
        _settle(admin)
        by_tier: dict[str, int] = {}
        for ctx in admin.contexts():
            by_tier[ctx.tier] = by_tier.get(ctx.tier, 0) + ctx.size_bytes
        assert by_tier.get("cpu", 0) <= MiB  # the quota, though the CPU tier has room
        assert by_tier.get("ssd", 0) == 2 * MiB
        for i in range(3):
            assert np.array_equal(a.get(f"c{i}"), np.full(MiB, i, np.uint8))
        with pytest.raises(errors.CapacityError, match="tenant 'a' quota exceeded"):
            a.put("too-much", np.zeros(3 * MiB, np.uint8))


def test_tenant_token_over_tcp_without_admin(start_daemon, tmp_path):
    cert, key = certificate(tmp_path)
    (tmp_path / "admin.token").write_text("admin-token")
    (tmp_path / "b.token").write_text("b-token")
    d = start_daemon(
        tcp_address="127.0.0.1:0",
        tls={"cert_file": str(cert), "key_file": str(key)},
        token_file=str(tmp_path / "admin.token"),
        tenants=[{"name": "b", "token_file": str(tmp_path / "b.token")}],
    )
    with KVClient(d.socket_path, tenant="b") as local:
        local.put("shared-name", b"b's bytes")
    addr = f"localhost:{tcp_port(d)}"
    with KVClient(address=addr, tls_ca_file=str(cert), token="b-token") as b:
        assert bytes(b.get("shared-name")) == b"b's bytes"
        with pytest.raises(errors.PermissionDeniedError, match="may not call the Admin"):
            b.status()
    with KVClient(address=addr, tls_ca_file=str(cert), token="admin-token") as admin:
        assert admin.lookup(["shared-name"]).found == (False,)  # default namespace
        assert admin.status().contexts == 1


def test_the_default_tenant_cannot_enter_a_named_tenants_namespace(start_daemon, tmp_path):
    """Issue 16 (5): with no tenant header (or the daemon token over TCP), get("a/secret")
    returned tenant a's bytes, and keys planted as "a/..." appeared to tenant a, uncharged,
    breaking its Release."""
    tcp = tcp_listener(tmp_path, "admin-token")
    d = start_daemon(tenants=TENANTS, **tcp.settings)
    ca = str(tcp.ca_file)
    with (
        KVClient(d.socket_path, tenant="a") as a,
        KVClient(d.socket_path) as default,
        KVClient(address=tcp.address(d), tls_ca_file=ca, token="admin-token") as daemon_token,
    ):
        a.put("secret", b"a's secret", context_id="doc")
        for c in (default, daemon_token):
            with pytest.raises(errors.PermissionDeniedError, match=r"tenant 'a'.s namespace"):
                c.get("a/secret")
            with pytest.raises(errors.PermissionDeniedError):
                c.lookup(["a/secret"])
            with pytest.raises(errors.PermissionDeniedError):
                c.put("a/planted", b"planted")
            with pytest.raises(errors.PermissionDeniedError):
                c.put("k", b"x", context_id="a/doc")
            with pytest.raises(errors.PermissionDeniedError):
                c.delete(["a/secret"])
        default.put("b-side/ok", b"not a tenant's name")  # only configured names are reserved
        assert a.lookup(["planted"]).found == (False,)
        with a.lease("secret") as (_, view):  # a's own reads and releases work
            assert bytes(view) == b"a's secret"


def test_an_object_stored_before_its_tenant_existed_stays_the_default_tenants(start_daemon):
    d = start_daemon(name="d")
    with KVClient(d.socket_path) as c:
        c.put("a/old", b"default's bytes", durable=True)
    d.stop()
    doc = yaml.safe_load(d.config.read_text())
    doc["tenants"] = TENANTS
    d.config.write_text(yaml.safe_dump(doc))
    d.start()
    with KVClient(d.socket_path, tenant="a") as a:
        assert a.lookup(["old"]).found == (False,)
        with pytest.raises(errors.NotFoundError):
            a.get("old")
        assert a.delete(["old"]) == 0
    with KVClient(d.socket_path) as admin:
        assert [c.context_id for c in admin.contexts()] == ["a/old"]  # admin still sees it
