"""Model cards (issue 27.2, 27.3): a card is parsed and checked before anything of its commit
is stored, so a malformed one never leaks its arena block; cards are a tenant's own (scoped,
charged to its quota, bounded in size and count), and a card sent over a stream answers OK.
Tenant a over the Unix socket, tenant b (no admin) over TCP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import yaml

from benchmarks._support.daemon_proc import REPO, DaemonProcess, tcp_listener, tcp_port
from kvtierd import errors
from kvtierd.client import KVClient
from kvtierd.engine.writes import MAX_CARDS_PER_TENANT
from kvtierd.kernels.chunk_codec import ChunkFormat
from kvtierd.kernels.placeholder import MAX_CARD_BYTES, MODEL_CARD_LAYOUT, ModelCard, model_card_key
from kvtierd.kernels.rope import RopeSpec
from kvtierd.rpc import kvtier_pb2 as pb

MiB = 1 << 20
MODEL = "/models/m"


def card(model: str = MODEL, head_dim: int = 64) -> bytes:
    return ModelCard(model, head_dim, RopeSpec.standard(head_dim).inv_freq, 1000, (0,)).to_bytes()


@contextmanager
def _daemon(
    start_daemon, tmp_path, *, arena_mib: int = 0, quota: dict[str, str] | None = None
) -> Iterator[tuple[DaemonProcess, KVClient, KVClient]]:
    tcp = tcp_listener(tmp_path, "admin-token")
    (tmp_path / "b.token").write_text("b-token")
    b = {"name": "b", "token_file": str(tmp_path / "b.token")}
    tenants = [{"name": "a"}, {**b, "quota": quota} if quota else b]
    cpu = f"{arena_mib}MiB" if arena_mib else "64MiB"
    d = start_daemon(cpu=cpu, tenants=tenants, **tcp.settings)
    if arena_mib:  # a small arena: a leak shows within a few puts
        d.stop()
        doc = yaml.safe_load(d.config.read_text())
        doc["tiers"][0]["options"]["staging_bytes"] = "1MiB"
        d.config.write_text(yaml.safe_dump(doc))
        d.start()
    with (
        KVClient(d.socket_path, tenant="a", timeout_s=20) as a,
        KVClient(address=tcp.address(d), tls_ca_file=str(tcp.ca_file), token="b-token") as bc,
    ):
        yield d, a, bc


def _put_card(c: KVClient, data: bytes, model: str = MODEL) -> pb.ObjectInfo:
    return c.put(model_card_key(model), data, context_id="card", layout=MODEL_CARD_LAYOUT)


def test_malformed_cards_are_refused_and_leak_nothing(start_daemon, tmp_path):
    deep = b"[" * (MAX_CARD_BYTES - 16)  # RecursionError in json before issue 27.2
    bad_cards = [
        deep,
        b'{"model": ' * 5000,
        json.dumps(
            {
                "model": MODEL,
                "head_dim": 64,
                "inv_freq": [float("nan")] * 32,
                "vocab_size": 1000,
                "special_ids": [],
            }
        ).encode(),
        json.dumps(
            {"model": MODEL, "head_dim": 0, "inv_freq": [], "vocab_size": -1, "special_ids": [5000]}
        ).encode(),
        json.dumps([1, 2, 3]).encode(),
    ]
    with _daemon(start_daemon, tmp_path, arena_mib=4) as (d, a, b):
        for _ in range(40):  # 40 x 64 KiB leaked would fill the 5 MiB arena
            for data in bad_cards:
                with pytest.raises(errors.InvalidArgumentError, match="model card"):
                    _put_card(b, data)
        with pytest.raises(errors.InvalidArgumentError, match="at most"):
            _put_card(b, b"{" + b" " * MAX_CARD_BYTES + b"}")
        a.put("big", b"x" * (3 * MiB), context_id="big")  # the arena is all there
        assert bytes(a.get("big")) == b"x" * (3 * MiB)
        with KVClient(d.socket_path) as admin:
            assert admin.status().health == "SERVING"


def test_a_card_over_a_stream_answers_ok(start_daemon, tmp_path):
    with _daemon(start_daemon, tmp_path) as (_, _a, b):
        spec = pb.ObjectSpec(key=model_card_key(MODEL), size_bytes=len(card()),
                             context_id="card", layout=MODEL_CARD_LAYOUT)  # fmt: skip
        parts = iter([pb.PutPart(spec=spec), pb.PutPart(data=card())])
        reply = b.call(b._put_stream_call, parts)
        assert reply.object.spec.key == model_card_key(MODEL)


def _chunk_key(model: str, i: int) -> str:
    return f"{model}@1@0@h{i}@bfloat16"  # LMCache's key: model@world@worker@hash@dtype


def _why_not_servable(admin: KVClient, cid: str) -> str:
    req = pb.DescribeContextRequest(context_id=cid)
    return admin.call(admin.admin.DescribeContext, req).reason


def test_a_tenants_card_applies_to_its_own_contexts_only(start_daemon, tmp_path):
    policy = str(REPO / "configs/policies/evicpress.yaml")
    tcp = tcp_listener(tmp_path, "admin-token")
    (tmp_path / "b.token").write_text("b-token")
    tenants = [{"name": "a"}, {"name": "b", "token_file": str(tmp_path / "b.token")}]
    d = start_daemon(policy_file=policy, tenants=tenants, **tcp.settings)
    layout = ChunkFormat((2, 2, 16, 64), "bfloat16", 2).layout()
    with (
        KVClient(d.socket_path, tenant="a") as a,
        KVClient(address=tcp.address(d), tls_ca_file=str(tcp.ca_file), token="b-token") as b,
        KVClient(d.socket_path) as admin,
    ):
        for i in range(2):
            b.put(_chunk_key(MODEL, i), b"\0" * 8192, context_id="doc", layout=layout,
                  token_count=16)  # fmt: skip
        assert f"no model card for b/{MODEL}" in _why_not_servable(admin, "b/doc")
        # a's card for "b/<model>" is a's own: it does not rotate b's contexts
        _put_card(a, card(f"b/{MODEL}"), model=f"b/{MODEL}")
        assert f"no model card for b/{MODEL}" in _why_not_servable(admin, "b/doc")
        # b's own card applies to b's contexts
        _put_card(b, card())
        assert "no model card" not in _why_not_servable(admin, "b/doc")
        # the default tenant cannot register into a tenant's namespace
        with pytest.raises(errors.PermissionDeniedError, match="namespace"):
            _put_card(admin, card(f"b/{MODEL}"), model=f"b/{MODEL}")
        # a card is put under its own model's key
        with pytest.raises(errors.InvalidArgumentError, match="key"):
            _put_card(b, card("/models/other"), model=MODEL)


def test_cards_are_bounded_in_count_and_charged_to_quota(start_daemon, tmp_path):
    with _daemon(start_daemon, tmp_path, quota={"cpu": "40KiB", "ssd": "40KiB"}) as (d, a, b):
        for i in range(MAX_CARDS_PER_TENANT):
            _put_card(a, card(f"/m/{i}"), model=f"/m/{i}")
        _put_card(a, card("/m/0", head_dim=128), model="/m/0")  # a new card replaces its own
        with pytest.raises(errors.CapacityError, match=f"at most {MAX_CARDS_PER_TENANT}"):
            _put_card(a, card("/m/extra"), model="/m/extra")
        big = ModelCard(MODEL, 64, RopeSpec.standard(64).inv_freq, 1 << 20,
                        tuple(range(1000))).to_bytes()  # fmt: skip
        for i in range(5):  # 5.5 KiB each: 28 KiB of b's 80 KiB quota
            _put_card(b, big.replace(MODEL.encode(), f"/x/{i}".encode()), model=f"/x/{i}")
        with pytest.raises(errors.CapacityError, match="quota exceeded"):
            b.put("k", b"\0" * (60 << 10), context_id="k")
        b.put("k", b"\0" * (40 << 10), context_id="k")
    d.stop()  # cards are kept across restarts, under their tenant's name, still charged
    d.start()
    with KVClient(address=_tcp_address(d), tls_ca_file=str(tmp_path / "localhost.pem"),
                  token="b-token") as b:  # fmt: skip
        b.delete(["k"])
        with pytest.raises(errors.CapacityError, match="quota exceeded"):
            b.put("k", b"\0" * (60 << 10), context_id="k")


def _tcp_address(d: DaemonProcess) -> str:
    return f"localhost:{tcp_port(d)}"
