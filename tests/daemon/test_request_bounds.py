"""Issue 27.6 and 27.7: requests are bounded in bytes (at the transport, and per method before
they are parsed), the ids and query text a tenant registers are counted in its budget, a
refused request is freed at once, and pending prompts are capped per tenant, so that one
tenant cannot push out another's. Over the Unix socket and over TCP with two tenants."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks._support.daemon_proc import tcp_listener
from kvtierd import errors
from kvtierd.client import KVClient
from kvtierd.engine.tokens import MAX_PENDING_PROMPTS
from kvtierd.rpc import kvtier_pb2 as pb
from kvtierd.server.kvstore import MAX_QUERY_TEXT_BYTES

MiB = 1 << 20


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _tokens(c: KVClient, **fields) -> None:
    c.call(c.kv.SetContextTokens, pb.SetContextTokensRequest(**fields))


def _two_tenants(start_daemon, tmp_path, **settings):
    tcp = tcp_listener(tmp_path, "admin-token")
    (tmp_path / "b.token").write_text("b-token")
    tenants = [{"name": "a"}, {"name": "b", "token_file": str(tmp_path / "b.token")}]
    d = start_daemon(tenants=tenants, **tcp.settings, **settings)
    b = KVClient(address=tcp.address(d), tls_ca_file=str(tcp.ca_file), token="b-token")
    return d, KVClient(d.socket_path, tenant="a"), b


def test_large_ids_and_queries_are_refused(start_daemon, tmp_path):
    d, a, b = _two_tenants(start_daemon, tmp_path, token_bytes_per_tenant="256KiB")
    with a, b:
        for c in (a, b):
            c.put("k", b"x", context_id="doc")
            with pytest.raises(errors.CapacityError, match="at most"):
                _tokens(c, request_id="r" * (9 * MiB), token_ids=[1])  # before it is parsed
            with pytest.raises(errors.InvalidArgumentError, match="request_id is longer"):
                _tokens(c, request_id="r" * 2048, token_ids=[1])
            big = pb.AddQueriesRequest(context_id="doc", texts=["q" * (MAX_QUERY_TEXT_BYTES + 1)])
            with pytest.raises(errors.InvalidArgumentError, match="at most"):
                c.call(c.kv.AddQueries, big)
            many = pb.AddQueriesRequest(context_id="doc", texts=["q" * 1000] * 1100)
            with pytest.raises(errors.CapacityError, match="at most"):
                c.call(c.kv.AddQueries, many)
            # query text counts in the tenant's budget: 256 KiB of it, then refused
            texts = [f"{i} " + "q" * 8000 for i in range(8)]
            req = pb.AddQueriesRequest(context_id="doc", texts=texts)
            with pytest.raises(errors.CapacityError, match="token_bytes_per_tenant"):
                for _ in range(10):
                    c.call(c.kv.AddQueries, req)
        with KVClient(d.socket_path) as admin:
            assert admin.status().health == "SERVING"


def test_refused_requests_are_freed(start_daemon, tmp_path):
    d, a, b = _two_tenants(start_daemon, tmp_path)
    ids = [(1 << 31) + i for i in range(MAX_PENDING_PROMPTS * 256)]  # ~5 MiB on the wire
    with a, b:
        for c in (a, b):  # warm up: the first of each costs the allocator its arenas
            with pytest.raises(errors.NotFoundError):
                _tokens(c, context_id="nowhere", request_id="r")
        before = _rss_bytes(d.proc.pid)
        for i in range(40):
            c = a if i % 2 else b
            with pytest.raises(errors.NotFoundError):
                _tokens(c, context_id="nowhere", token_ids=ids)
            with pytest.raises(errors.CapacityError):
                _tokens(c, request_id="r" * (9 * MiB), token_ids=[1])
        grown = _rss_bytes(d.proc.pid) - before
        # 40 x ~14 MiB (the bytes and the parsed ids) stayed before issue 27.6
        assert grown < 160 * MiB, f"the daemon grew {grown / MiB:.0f} MiB"


def test_pending_prompts_are_capped_per_tenant(start_daemon, tmp_path):
    _, a, b = _two_tenants(start_daemon, tmp_path)
    with a, b:
        b.put("k", b"x", context_id="doc")
        b.note_prompt("b-prompt", [1, 2, 3])
        for i in range(MAX_PENDING_PROMPTS + 10):
            a.note_prompt(f"a-{i}", [1])
        b.link_prompt("doc", "b-prompt")  # NOT_FOUND when a's prompts pushed it out
        a.put("k", b"x", context_id="doc")
        with pytest.raises(errors.NotFoundError):
            a.link_prompt("doc", "a-0")  # a's own oldest went
        a.link_prompt("doc", f"a-{MAX_PENDING_PROMPTS + 9}")
