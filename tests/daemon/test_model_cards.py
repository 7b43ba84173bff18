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

from kvtierd import errors
from kvtierd.client import KVClient
from kvtierd.kernels.placeholder import MAX_CARD_BYTES, MODEL_CARD_LAYOUT, ModelCard, model_card_key
from kvtierd.kernels.rope import RopeSpec
from kvtierd.rpc import kvtier_pb2 as pb
from tests.daemon_proc import DaemonProcess, tcp_listener

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
        KVClient(address=tcp.address, tls_ca_file=str(tcp.ca_file), token="b-token") as bc,
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
