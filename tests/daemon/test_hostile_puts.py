"""Issue 27.4 and 27.5: a put whose variant or layout the daemon cannot use is refused at the
edge (INVALID_ARGUMENT naming the field, nothing stored, a retry is not ALREADY_EXISTS), and
a put whose bytes make a profile fail (random bytes in a valid layout: quality NaN) sets that
one context aside with the reason in DescribeContext; profiling goes on, health stays
SERVING, and SIGTERM exits 0. Over the Unix socket and over TCP as a tenant without admin."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from benchmarks._support.daemon_proc import REPO, DaemonProcess, tcp_listener
from kvtierd import errors
from kvtierd.client import KVClient
from kvtierd.kernels.chunk_codec import ChunkFormat
from kvtierd.rpc import kvtier_pb2 as pb

L, H, D, T = 2, 2, 32, 16
SHAPE = (2, L, T, H * D)
CHUNK_BYTES = 2 * L * T * H * D * 2
GOOD_LAYOUT = ChunkFormat(SHAPE, "bfloat16", H).layout()

# (variant, layout, size_bytes, what the refusal must name)
BAD_PUTS = [
    ("zzz@9.9+int99", "", 64, "variant"),
    ("knorm@2", "", 64, "ratio"),
    ("", "KV_2LTD;2x2x16x64;bfloat16;h=0", CHUNK_BYTES, "h=0"),
    ("", "KV_2LTD;2x2x16x64;bfloat16;h=3", CHUNK_BYTES, "h=3"),
    ("", "KV_2LTD;2x2x16x64;nonsense;h=2", CHUNK_BYTES, "dtype"),
    ("int8", "KV_2LTD;2x2x16x64;bfloat16;h=2;int8;g=0", 100, "group size"),
    ("int8", "KV_2LTD;2x2x16x64;bfloat16;h=2;int99;g=32", 100, "quantization"),
    ("", "KV_2LTD;0x2x16x64;bfloat16;h=2", CHUNK_BYTES, "shape"),
    ("", "KV_2LTD;2x2x16x64;bfloat16;h=2", CHUNK_BYTES + 2, "size_bytes"),
    ("", "my-own-layout", 64, "layout"),
]

TENANTS = [{"name": "a"}, {"name": "b"}]


def _good_chunk(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*SHAPE, generator=g).to(torch.bfloat16)
    return bytes(x.view(torch.uint8).numpy().tobytes())


@contextmanager
def _clients(start_daemon, tmp_path) -> Iterator[tuple[DaemonProcess, list[KVClient]]]:
    """A daemon under EvicPress; tenant a over the Unix socket, tenant b (no admin) over TCP."""
    tcp = tcp_listener(tmp_path, "admin-token")
    (tmp_path / "b.token").write_text("b-token")
    tenants = [TENANTS[0], {"name": "b", "token_file": str(tmp_path / "b.token")}]
    policy = tmp_path / "quantizing.yaml"  # no token dropping: no kernel checks the keys
    text = (REPO / "configs/policies/evicpress.yaml").read_text()
    text = text.replace("[knorm, keydiff, int8, int4, knorm+int8]", "[int8, int4]")
    # attention reads the KV (query_attention without a model scores by its labels' prior):
    # random bytes must reach an evaluator to test that a broken profile stays contained
    policy.write_text(text.replace("estimator: query_attention", "estimator: attention"))
    d = start_daemon(policy_file=str(policy), tenants=tenants, **tcp.settings)
    with (
        KVClient(d.socket_path, tenant="a", timeout_s=20) as a,
        KVClient(address=tcp.address(d), tls_ca_file=str(tcp.ca_file), token="b-token") as b,
    ):
        yield d, [a, b]


def _wait_profiled(admin: KVClient, cid: str, timeout_s: float = 60) -> pb.ProfileStatusResponse:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = admin.call(admin.admin.ProfileStatus, pb.ProfileStatusRequest(context_id=cid))
        if st.profiled:
            return st
        time.sleep(0.2)
    raise AssertionError(f"{cid} was not profiled within {timeout_s} s")


@pytest.mark.parametrize("bad", BAD_PUTS, ids=[b[3] for b in BAD_PUTS])
def test_a_bad_variant_or_layout_is_refused_before_anything_is_stored(start_daemon, tmp_path, bad):
    variant, layout, size, names = bad
    with _clients(start_daemon, tmp_path) as (d, clients), KVClient(d.socket_path) as admin:
        for c in clients:
            with pytest.raises(errors.InvalidArgumentError, match=names):
                c.put("k", b"\0" * size, context_id="doc", variant=variant, layout=layout)
            assert c.lookup(["k"]).found == (False,)
            c.put("k", b"\0" * 64, context_id="doc")  # the retry is not ALREADY_EXISTS
            assert bytes(c.get("k")) == b"\0" * 64
        assert admin.status().health == "SERVING"
        # the same over PutStream (its own path into the engine)
        spec = pb.ObjectSpec(key="s", size_bytes=size, context_id="s", variant=variant,
                             layout=layout)  # fmt: skip
        parts = iter([pb.PutPart(spec=spec), pb.PutPart(data=b"\0" * size)])
        with pytest.raises(errors.InvalidArgumentError):
            clients[1].call(clients[1]._put_stream_call, parts)
        assert clients[1].lookup(["s"]).found == (False,)


def test_a_put_that_breaks_its_profile_sets_only_that_context_aside(start_daemon, tmp_path):
    with _clients(start_daemon, tmp_path) as (d, (a, b)), KVClient(d.socket_path) as admin:
        # Random bytes in a valid bfloat16 chunk layout: huge and inf keys, a NaN quality.
        rng = np.random.default_rng(0)
        bad = rng.integers(0, 256, CHUNK_BYTES, dtype=np.uint8).tobytes()
        for c in (a, b):
            for i in range(2):
                c.put(f"bad-{i}", bad, context_id="bad", layout=GOOD_LAYOUT, token_count=T)
        time.sleep(3)  # settle_s, then the profiling loop's pass over it
        for tenant in ("a", "b"):
            for i in range(2):
                c = a if tenant == "a" else b
                c.put(f"good-{i}", _good_chunk(i), context_id="good", layout=GOOD_LAYOUT,
                      token_count=T)  # fmt: skip
        for tenant in ("a", "b"):
            st = _wait_profiled(admin, f"{tenant}/good")
            assert st.profiled
        assert admin.status().health == "SERVING"
        for tenant in ("a", "b"):
            desc = admin.call(admin.admin.DescribeContext,
                              pb.DescribeContextRequest(context_id=f"{tenant}/bad"))  # fmt: skip
            assert "not profiled" in desc.reason and "quality" in desc.reason, desc.reason
            for o in desc.options:
                assert 0.0 <= o.quality <= 1.0
        status = admin.call(admin.admin.ProfileStatus, pb.ProfileStatusRequest())
        assert status.runs_failed >= 2 and status.runs_ok >= 2
        assert admin.call(admin.admin.Rebalance, pb.RebalanceRequest()) is not None
        assert admin.status().health == "SERVING"
    assert d.stop() == 0
